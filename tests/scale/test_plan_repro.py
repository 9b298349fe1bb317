"""Stage plan@repro under the real `dvc repro` and `dvc exp run --queue` on a host that shows GPUs (8 faked through
torch itself: tests/fixtures/fake_cuda/sitecustomize.py on PYTHONPATH makes `torch.cuda` report 8 NVIDIA H200), on
the miniature real tree with the real base profile (params.real.yaml) and DeGLA's recipe. Nothing here replaces the
plan's check of the negatives stage: it reads the project's dvc.lock, as it does on a real host.

One scenario, in order (the fixture), each test asserting on its record:
1. the base profile with the LLM server up: 8 GPUs and compute.llm_gpus 0 is refused (the server's card would hold a
   rank), 7 + 1 passes;
2. DeGLA before its negatives, server up, 7 + 1: plan@repro passes and negatives@coco asks the LLM;
3. the server stopped, compute.llm_gpus 0: DeGLA and the base profile pass on all 8 GPUs and ask nothing (negatives
   up to date); a queued sweep does the same;
4. a code edit to the negatives stage: it would run again, so the stopped server is refused.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from fixtures import real_tree
from fixtures.llm import openai_server, rewrite_reply
from fixtures.project import copy_project, env

from clipfinetune.project import profile

ROOT = Path(__file__).resolve().parents[2]
FAKE_CUDA = Path(__file__).resolve().parents[1] / "fixtures" / "fake_cuda"
ALL_8 = "0,1,2,3,4,5,6,7"
RAN = re.compile(r"Running stage '([^']+)'")


def gpu_env(gpus: int) -> dict:
    out = env()
    out["PYTHONPATH"] = os.pathsep.join(filter(None, [str(FAKE_CUDA), out.get("PYTHONPATH", "")]))
    out["CLIPFINETUNE_FAKE_CUDA"] = f"{gpus}:NVIDIA H200"
    return out


def dvc(root: Path, *args: str, gpus: int = 8) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=root, env=gpu_env(gpus), capture_output=True,
                          text=True, check=False)
    proc.out = proc.stdout + proc.stderr
    return proc


def configure(root: Path, recipe: str, base_url: str, llm_gpus: int) -> None:
    """params.yaml = the committed sample params, then params.real.yaml (+ the recipe), as `clipfinetune recipe`
    writes it; the LLM at `base_url`; compute.llm_gpus as given."""
    path = root / "params.yaml"
    path.write_text(subprocess.run(["git", "show", "HEAD:params.yaml"], cwd=ROOT, capture_output=True, text=True,
                                   check=True).stdout)
    profile.apply([ROOT / "params.real.yaml", *([ROOT / "recipes" / f"{recipe}.yaml"] if recipe else [])], path)
    params = yaml.safe_load(path.read_text())
    params["negatives"]["base_url"] = base_url
    params["compute"]["llm_gpus"] = llm_gpus
    path.write_text(yaml.safe_dump(params))


def git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True,
                   capture_output=True)


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    from clipfinetune.models import export_model, load_model

    top = tmp_path_factory.mktemp("plan-repro")
    root = copy_project(top / "project")
    real_tree.build(top / "disk")              # the data disk, reached through the committed `datasets` link
    (root / "datasets").symlink_to(top / "disk" / "datasets", target_is_directory=True)
    export_model(load_model("cft-tiny-vit"), root / "datasets/weights/ViT-L-14-336-openai")
    (root / "datasets/weights/sam_vit_h_4b8939.pth").write_bytes(b"stand-in")
    git(root, "init", "-q")
    seen = {}
    with openai_server(rewrite_reply(real_tree.NOUNS, real_tree.ADJECTIVES)) as (base_url, received):
        configure(root, "", base_url, 0)
        seen["base 8+0"] = dvc(root, "repro", "plan@repro")
        configure(root, "", base_url, 1)
        seen["base 7+1"] = dvc(root, "repro", "plan@repro")
        configure(root, "degla", base_url, 1)
        seen["degla before"] = dvc(root, "repro", "plan@repro", "negatives@coco")
        seen["asked before"] = len(received)
    # the server is stopped: the same base_url answers nothing now
    configure(root, "degla", base_url, 0)
    seen["degla after"] = dvc(root, "repro", "plan@repro", "negatives@coco")
    seen["status after"] = dvc(root, "status", "negatives@coco")
    configure(root, "", base_url, 0)
    seen["base after"] = dvc(root, "repro", "plan@repro")
    configure(root, "degla", base_url, 0)
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "DeGLA, negatives done, server stopped")
    queued = dvc(root, "exp", "run", "--queue", "-n", "lr2", "-S", "train.degla.lr=2e-6", "plan@repro",
                 "negatives@coco")
    assert queued.returncode == 0, queued.out[-3000:]
    dvc(root, "queue", "start")
    t0 = time.perf_counter()
    while any(w in line.split() for line in dvc(root, "queue", "status").stdout.splitlines()[1:]
              for w in ("Queued", "Running")):
        assert time.perf_counter() - t0 < 300, "the queued experiment did not finish in 5 min"
        time.sleep(2)
    seen["queue status"] = dvc(root, "queue", "status").stdout
    seen["queue logs"] = dvc(root, "queue", "logs", "lr2").out
    dvc(root, "queue", "stop")
    # an edit of the negatives stage's code: DVC would run it again, and it would ask the stopped server
    rules = root / "clipfinetune/data/negatives/rules.py"
    rules.write_text(rules.read_text() + "\n# an edit\n")
    seen["edited"] = dvc(root, "repro", "plan@repro")
    seen["status edited"] = dvc(root, "status", "negatives@coco")
    return seen


def ranks_line(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("clipfinetune plan:"))


def row(out: str, stage: str) -> list[str]:
    return next(line.split() for line in out.splitlines() if line.startswith(stage + " "))


def test_no_stage_asks_dvc_about_the_repository_it_runs_in(scenario):
    for name, proc in scenario.items():
        if isinstance(proc, subprocess.CompletedProcess):
            assert "LockError" not in proc.out and "is busy" not in proc.out, (name, proc.out[-3000:])


def test_the_base_profile_on_8_gpus_keeps_one_for_the_server_or_is_refused(scenario):
    refused = scenario["base 8+0"]
    assert refused.returncode != 0 and "[negatives@coco] compute.llm_gpus" in refused.out, refused.out[-3000:]
    assert "CUDA_VISIBLE_DEVICES=7" in refused.out
    passed = scenario["base 7+1"]
    assert passed.returncode == 0, passed.out[-3000:]
    assert "8 GPU(s) (NVIDIA H200)" in ranks_line(passed.out)
    assert ranks_line(passed.out).endswith("ranks on GPU(s) 0,1,2,3,4,5,6")
    assert row(passed.out, "eval_base")[1:4] == ["cuda", "0,1,2,3,4,5,6", "7"]      # an item stage: all 7


def test_degla_before_its_negatives_asks_the_llm_on_7_gpus_plus_its_server(scenario):
    before = scenario["degla before"]
    assert before.returncode == 0, before.out[-3000:]
    assert set(RAN.findall(before.out)) == {"plan@repro", "code", "negatives@coco"}    # code: the first repro
    assert scenario["asked before"] > 0
    assert ranks_line(before.out).endswith("ranks on GPU(s) 0,1,2,3,4,5,6")      # the server keeps GPU 7
    assert row(before.out, "train@degla")[1:4] == ["cuda", "0,1,2,3", "4"]      # 256 splits over 4 of the 7


def test_after_its_negatives_degla_trains_on_every_gpu_and_asks_nothing(scenario):
    after = scenario["degla after"]
    assert after.returncode == 0, after.out[-3000:]
    assert RAN.findall(after.out) == ["plan@repro"], after.out[-3000:]          # negatives@coco: up to date
    assert "negatives@coco is up to date: the vLLM server is not needed" in after.out
    assert row(after.out, "train@degla")[1:4] == ["cuda", ALL_8, "8"]
    assert "changed" not in scenario["status after"].stdout                   # DVC agrees: nothing to re-run
    base = scenario["base after"]
    assert base.returncode == 0, base.out[-3000:]
    assert ranks_line(base.out).endswith(f"ranks on GPU(s) {ALL_8}")


def test_a_queued_sweep_after_the_negatives_asks_nothing_and_trains_on_every_gpu(scenario):
    assert "Success" in scenario["queue status"], scenario["queue status"] + scenario["queue logs"][-3000:]
    logs = scenario["queue logs"]
    assert RAN.findall(logs) == ["plan@repro"], logs[-3000:]
    assert row(logs, "train@degla")[1:4] == ["cuda", ALL_8, "8"]


def test_when_the_negatives_would_run_again_the_stopped_server_is_refused(scenario):
    edited = scenario["edited"]
    assert "changed" in scenario["status edited"].stdout or "modified" in scenario["status edited"].stdout
    assert edited.returncode != 0 and "negatives.base_url: no LLM endpoint" in edited.out, edited.out[-3000:]
