"""tests/real_vllm/ runs only under `make test-vllm`, which builds vLLM's own venv and passes its python as
$VLLM_PYTHON; `make test` (no $VLLM_PYTHON) does not collect it."""
import os

collect_ignore_glob = [] if os.environ.get("VLLM_PYTHON") else ["test_*.py"]
