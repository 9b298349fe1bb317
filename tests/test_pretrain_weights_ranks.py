"""`pretrain` with real weights (`model.pretrained` set) at any rank count: it only exports the weights, so it runs as
one process whatever `compute.nproc` says (it stopped before with "declared params never read: compute.device"),
leaving models/base equal to the given weights. Under torchrun by hand (2 gloo ranks):
tests/scale/test_pretrain_torchrun.py."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures.project import copy_project, write_params

ROOT = Path(__file__).resolve().parents[1]
WEIGHTS = "datasets/weights/tiny"


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    from clipfinetune.models import export_model, load_model

    repo = copy_project(tmp_path_factory.mktemp("pretrain_weights") / "project")
    (repo / "params.yaml").write_text(subprocess.run(["git", "show", "HEAD:params.yaml"], cwd=ROOT, check=True,
                                                     capture_output=True, text=True).stdout)
    write_params(repo, {"model": {"pretrained": f"local-dir:{WEIGHTS}"}, "compute": {"device": "cpu", "nproc": 2}})
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    torch.manual_seed(0)
    export_model(load_model("cft-tiny-vit"), repo / WEIGHTS)
    return repo


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "DVC_STAGE")}
    return {**env, "OMP_NUM_THREADS": "1"}


def _same_weights(repo: Path) -> None:
    from safetensors.torch import load_file

    given = load_file(repo / WEIGHTS / "open_clip_model.safetensors")
    exported = load_file(repo / "models/base/open_clip_model.safetensors")
    assert given.keys() == exported.keys() and all(torch.equal(given[k], exported[k]) for k in given)


def export(project: Path, launcher: list[str]) -> str:
    """Run the pretrain stage (under `launcher`, e.g. torchrun) in the project; its log."""
    import shutil

    shutil.rmtree(project / "models", ignore_errors=True)
    cmd = [*(launcher or [sys.executable]), "stages/pretrain.py", "--stage", "pretrain"]
    proc = subprocess.run(cmd, cwd=project, env=_env(), capture_output=True, text=True, timeout=600, check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "never read" not in log
    _same_weights(project)
    assert (project / "dvclive/pretrain/skipped.json").is_file()
    return log


def test_pretrain_with_weights_at_compute_nproc_2_exports_as_one_process(project):
    assert "launching" not in export(project, [])        # one process: nothing to split
