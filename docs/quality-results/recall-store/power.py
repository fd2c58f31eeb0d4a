"""Exact power of the two-sided sign test (p < 0.05) on paired questions for a 5-point accuracy difference:
the questions two settings answer differently (share d) are won by the better one with probability
(d + 0.05) / (2 d); the smallest number of questions with an even chance and with 80 % power, per d."""
from math import comb, lgamma, log, exp
def pmf(k, n, p):
    if p in (0,1): return float((k==0 and p==0) or (k==n and p==1))
    return exp(lgamma(n+1)-lgamma(k+1)-lgamma(n-k+1)+k*log(p)+(n-k)*log(1-p))
def crit(D):
    # smallest w > D/2 with two-sided sign test p < 0.05
    for w in range(D//2+1, D+1):
        tail=sum(comb(D,k) for k in range(0, D-w+1))/2**D
        if 2*tail<0.05: return w
    return None
CR={}
def power(n, d, delta):
    pi=(d+delta)/(2*d); tot=0
    for D in range(n+1):
        pD=pmf(D,n,d)
        if pD<1e-10: continue
        if D not in CR: CR[D]=crit(D)
        w0=CR[D]
        if w0 is None: continue
        tot+=pD*sum(pmf(w,D,pi) for w in range(w0,D+1))
    return tot
for d in (0.10,0.15,0.20,0.25):
    out=[]
    for target in (0.5,0.8):
        n=40
        while power(n,d,0.05)<target: n+=10
        out.append(n)
    print(f"d={d}: 50% power n={out[0]}, 80% power n={out[1]}")
