import numpy as np


def max_diff(a, b) -> float:
    return float(np.abs(np.array(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).max())
