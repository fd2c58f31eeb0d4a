#!/usr/bin/env bash
# Regenerates the bundled sample media in assets/media (see assets/media/README.md): ten one-second scenes with
# a changing background, word, square and moving disc, plus espeak-ng speech, muxed into a 10 s A/V clip.
# Needs Debian's ffmpeg, espeak-ng and fonts-dejavu-core; CI does not run it (the outputs are committed).
set -euo pipefail
out="${1:-$(cd "$(dirname "$0")/.." && pwd)/assets/media}"
font=/usr/share/fonts/truetype/dejavu/DejaVuSans-Bold.ttf
for tool in ffmpeg espeak-ng; do command -v "$tool" >/dev/null || { echo "needs $tool" >&2; exit 1; }; done
[ -f "$font" ] || { echo "needs fonts-dejavu-core ($font)" >&2; exit 1; }
mkdir -p "$out"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
bgs=(red green blue yellow purple orange cyan magenta gray white)
words=(APPLE BICYCLE CAT DOG ELEPHANT FLOWER GUITAR HOUSE ISLAND JUNGLE)
inks=(white white white black white black black white black black)
: > "$tmp/list.txt"
for k in $(seq 0 9); do
  ink=${inks[$k]}
  vf="drawtext=fontfile=$font:text='t=%{pts\\:hms\\:$k}':fontsize=20:fontcolor=$ink:x=10:y=10"
  vf="$vf,drawtext=fontfile=$font:text='SECOND $k':fontsize=56:fontcolor=$ink:x=(w-text_w)/2:y=60"
  vf="$vf,drawtext=fontfile=$font:text='${words[$k]}':fontsize=44:fontcolor=$ink:x=(w-text_w)/2:y=150"
  vf="$vf,drawbox=x=20+$k*38:y=260:w=60:h=60:color=$ink:t=fill"
  vf="$vf,drawtext=fontfile=$font:text='●':fontsize=64:fontcolor=$ink:x=20+t*360:y=350"
  ffmpeg -loglevel error -y -f lavfi -i "color=c=${bgs[$k]}:s=448x448:r=24:d=1" -vf "$vf" \
    -c:v libx264 -pix_fmt yuv420p -preset veryfast -crf 18 -g 24 "$tmp/seg$k.mp4"
  echo "file '$tmp/seg$k.mp4'" >> "$tmp/list.txt"
done
ffmpeg -loglevel error -y -f concat -safe 0 -i "$tmp/list.txt" -c copy "$tmp/video.mp4"
text="Hello. This is a short test of a streaming omni model. The capital of France is Paris. One, two, three, four, five."
printf '%s\n' "$text" > "$out/speech_text.txt"
espeak-ng -v en-us -s 150 -w "$tmp/raw.wav" "$text"
ffmpeg -loglevel error -y -i "$tmp/raw.wav" -ar 16000 -ac 1 -c:a pcm_s16le "$out/speech_16k.wav"
ffmpeg -loglevel error -y -f lavfi -i "sine=frequency=440:sample_rate=16000:duration=1" -ac 1 -c:a pcm_s16le \
  "$out/tone_440_1s_16k.wav"
ffmpeg -loglevel error -y -i "$tmp/video.mp4" -i "$out/speech_16k.wav" -filter_complex "[1:a]apad=whole_dur=10[a]" \
  -map 0:v -map "[a]" -c:v copy -c:a aac -b:a 64k -ar 16000 -ac 1 -t 10 "$out/video_10s_av.mp4"
echo "wrote $out"
