"""`clipfinetune data` (clipfinetune/project/data.py) and its manifest (clipfinetune/project/datasets.yaml), without
the internet: a local mirror (tests/fixtures/data_server.py) serves the miniature real tree's files packed as each
source packs them. Checked here:

- every path params.real.yaml and each recipe reads belongs to a manifest dataset with its source page, license and
  the date it was checked, and a download or manual steps; docs/real-data.md's layout table is the manifest's;
- the table: absent / incomplete (what is missing) / present, manual steps printed, a placed manual dataset found;
- `--fetch` of HarmoCLIP's data from the mirror gives the tree's files byte for byte in the expected layout (zip,
  tar.gz, a zip inside a zip, single files, members left out), and a re-run requests nothing;
- a connection dropped mid-file resumes with an HTTP range (in the same run, and from the .part in a later run);
- a corrupt archive, a checksum mismatch and a 404 fail naming the dataset and the URL, leaving complete data;
- `clipfinetune plan` groups missing inputs by dataset and names the command that fetches them;
- README's real-data commands, as written, on a project copy against the mirror (the last, `dvc exp run`, in
  tests/scale/test_data_fetch_repro.py: minutes).
"""
from __future__ import annotations

import filecmp
import os
import re
import shutil
import zipfile
from pathlib import Path

import pytest
import yaml
from fixtures.data_server import UNUSED, miniature_mirror, serve
from fixtures.project import committed

from clipfinetune.project import data, profile

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ("harmoclip", "fsc_clip", "goal", "degla", "mulclip")
PAPER = "harmoclip"                 # the README's example: its data is all downloadable but Flickr30K's images


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    mirror = miniature_mirror(tmp_path_factory.mktemp("data"))
    with serve(mirror["mirror"]) as (url, server):
        yield {**mirror, "url": url, "server": server}


def project_root(tmp_path: Path) -> Path:
    """What `clipfinetune data <paper>` reads: params.yaml, params.real.yaml, recipes/."""
    (tmp_path / "params.yaml").write_text(committed("params.yaml"))
    shutil.copy(ROOT / "params.real.yaml", tmp_path / "params.real.yaml")
    shutil.copytree(ROOT / "recipes", tmp_path / "recipes")
    return tmp_path


def cli(world, root: Path, *args: str):
    env = {**os.environ, data.MIRROR_ENV: world["url"], data.MANIFEST_ENV: str(world["manifest_path"])}
    return run_env(root, env, "clipfinetune", "data", *args)


def run_env(cwd, env, *cmd):
    import subprocess

    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)


def rows(out: str) -> dict[str, str]:
    """dataset -> state, from the table."""
    states = ("present", "incomplete", "absent")
    return {p[0]: p[1] for p in (line.split() for line in out.splitlines()) if len(p) > 2 and p[1] in states}


# ------------------------------------------------------------------------------------------------ the manifest
@pytest.mark.parametrize("recipe", (None, *RECIPES))
def test_every_path_a_recipe_reads_is_a_manifest_dataset_with_its_source_and_the_date_checked(recipe):
    manifest = data.load_manifest()
    files = [ROOT / "params.real.yaml"] + ([ROOT / "recipes" / f"{recipe}.yaml"] if recipe else [])
    params = profile.layered(yaml.safe_load(committed("params.yaml")), *map(profile.load_plain, files))
    needed, unknown = data.datasets_needed(params, manifest)
    assert unknown == [], unknown
    assert needed
    for name in needed:
        d = manifest[name]
        assert d.page.startswith("https://") and d.license and str(d.checked) == "2026-11-28", name
        assert d.fetch or d.manual, name                      # a download, or the steps
        assert d.verified or d.note or d.manual, f"{name}: unverified without a note"
        for item in d.fetch:
            assert item["url"].startswith(("http://", "https://")) and item["kind"] in ("zip", "tar.gz", "file")


def test_docs_layout_table_is_the_manifests():
    text = (ROOT / "docs" / "real-data.md").read_text()
    table = {m.group(1): m.group(2) for m in re.finditer(r"^\| `([\w/{}-]+)` \| ([^|]+) \|", text, re.MULTILINE)}
    raw = yaml.safe_load(data.MANIFEST.read_text())
    assert set(table) == set(raw)
    for name, entry in raw.items():
        for path in entry["paths"]:
            assert f"`{path}`" in table[name], (name, path)


# ------------------------------------------------------------------------------------------------ the table
def test_an_empty_datasets_folder_lists_every_dataset_absent_with_the_manual_steps(world, tmp_path):
    root = project_root(tmp_path)
    proc = cli(world, root, PAPER)
    assert proc.returncode == 1
    states = rows(proc.stdout)
    assert set(states) == {"coco_train2017", "coco_val2017", "coco_annotations_2017", "coco_panoptic_val2017",
                           "karpathy", "flickr30k", "coco_train2014", "coco_annotations_2014", "docci"}, proc.stdout
    assert set(states.values()) == {"absent"}
    assert "shannon.cs.illinois.edu/DenotationGraph" in proc.stdout and "manual steps" in proc.stdout
    assert "clipfinetune data --fetch" in proc.stdout


def test_an_incomplete_dataset_names_what_is_missing(world, tmp_path):
    root = project_root(tmp_path)
    shutil.copytree(world["tree"] / "datasets/coco/val2017", root / "datasets/coco/val2017")
    next((root / "datasets/coco/val2017").iterdir()).unlink()
    proc = cli(world, root, PAPER)
    assert rows(proc.stdout)["coco_val2017"] == "incomplete"
    want = len(list((world["tree"] / "datasets/coco/val2017").iterdir()))
    assert f"coco_val2017: missing datasets/coco/val2017: {want - 1} of {want} files" in proc.stdout


# ------------------------------------------------------------------------------------------------ fetch
@pytest.fixture(scope="module")
def fetched(world, tmp_path_factory):
    root = project_root(tmp_path_factory.mktemp("fetched"))
    world["server"].requests.clear()
    proc = cli(world, root, PAPER, "--fetch")
    return {"root": root, "proc": proc, "requests": list(world["server"].requests)}


def test_fetch_unpacks_each_format_into_the_layout_byte_for_byte(world, fetched):
    root, proc = fetched["root"], fetched["proc"]
    assert proc.returncode == 1, proc.stdout + proc.stderr           # Flickr30K's images are a manual step
    states = rows(proc.stdout)
    assert states.pop("flickr30k") == "absent" and set(states.values()) == {"present"}, proc.stdout
    manifest = world["manifest"]
    for name in states:
        for rel in [f for p in manifest[name].paths for f in _files(world["tree"], p)]:
            assert filecmp.cmp(world["tree"] / rel, root / rel, shallow=False), rel
    assert (root / "datasets/coco/annotations/panoptic_val2017").is_dir()       # the zip inside the zip
    assert not (root / "datasets/coco/annotations/panoptic_val2017.zip").exists()
    assert not list(root.rglob(UNUSED))                                        # `only` leaves members out
    assert not list((root / "datasets").rglob("*.part")) and not list((root / "datasets/.tmp").iterdir())
    assert not list((root / data.DOWNLOADS).iterdir())                          # archives removed once unpacked
    assert "ETA" in proc.stderr and "/s" in proc.stderr                         # progress with rate and ETA


def _files(tree: Path, rel: str) -> list[str]:
    full = tree / rel
    if full.is_file():
        return [rel]
    return [str(p.relative_to(tree)) for p in full.rglob("*") if p.is_file()]


def test_a_placed_manual_dataset_is_found_and_a_rerun_fetches_nothing(world, fetched):
    root = fetched["root"]
    shutil.copytree(world["tree"] / "datasets/flickr30k", root / "datasets/flickr30k")   # the manual step
    world["server"].requests.clear()
    proc = cli(world, root, PAPER, "--fetch")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert set(rows(proc.stdout).values()) == {"present"}
    assert world["server"].requests == []


def _only(world, name: str) -> data.Dataset:
    return world["manifest"][name]


def test_a_dropped_connection_resumes_with_a_range_in_the_same_run_and_in_the_next(world, tmp_path):
    d = _only(world, "coco_val2017")
    path = "/images.cocodataset.org/zips/val2017.zip"
    size = (world["mirror"] / path.lstrip("/")).stat().st_size
    server = world["server"]
    server.requests.clear()
    server.drop_once.add(path)
    data.fetch_dataset(d, tmp_path, world["url"])
    starts = [int(r.split("=")[1].split("-")[0]) for p, r in server.requests if p == path and r]
    assert len(server.requests) == 2 and starts == [size // 2]
    assert data.status(d, tmp_path).state == "present"
    # a run that gives up (no retries) keeps the .part; the next run asks only for the rest
    (tmp_path / data.STAMPS / "coco_val2017.json").unlink()
    shutil.rmtree(tmp_path / "datasets/coco/val2017")
    server.requests.clear()
    server.drop_once.add(path)
    with pytest.raises(data.FetchError, match=r"coco_val2017: http://127\.0\.0\.1:\d+/images\.cocodataset\.org/zips/"
                                              r"val2017\.zip: truncated"):
        data.fetch_dataset(d, tmp_path, world["url"], retries=0)
    part = tmp_path / data.DOWNLOADS / "val2017.zip.part"
    assert part.stat().st_size == size // 2 and not (tmp_path / "datasets/coco/val2017").exists()
    data.fetch_dataset(d, tmp_path, world["url"])
    assert server.requests[-1] == (path, f"bytes={size // 2}-")
    assert data.status(d, tmp_path).state == "present" and not part.exists()


def test_a_file_replaced_on_the_server_since_the_part_began_is_fetched_whole(world, tmp_path):
    """The .part keeps the ETag its bytes came with and a resume sends it as If-Range: a source that replaced the
    archive meanwhile sends the whole new file, so the result is never old bytes followed by new ones."""
    mirror = tmp_path / "mirror"
    shutil.copytree(world["mirror"], mirror)
    path = "/images.cocodataset.org/zips/val2017.zip"
    archive = mirror / path.lstrip("/")
    d, root = _only(world, "coco_val2017"), tmp_path / "root"
    with serve(mirror) as (url, server):
        server.drop_once.add(path)
        with pytest.raises(data.FetchError, match="truncated"):
            data.fetch_dataset(d, root, url, retries=0)
        assert server.if_range == [None]            # a fresh start asks for the whole file
        with zipfile.ZipFile(archive) as z:         # the source re-packs: every member's bytes changed
            members = {i.filename: z.read(i) for i in z.infolist() if not i.is_dir()}
        replaced = {name: body + b"\0" for name, body in members.items()}
        with zipfile.ZipFile(archive, "w") as z:
            for name, body in replaced.items():
                z.writestr(name, body)
        server.requests.clear()
        server.if_range.clear()
        data.fetch_dataset(d, root, url)
    (ranged,) = server.requests
    assert ranged[1].startswith("bytes=") and server.if_range[0].startswith('"')   # the rest, if unchanged
    for name, body in replaced.items():
        assert (root / "datasets/coco" / name).read_bytes() == body, name
    assert not list((root / data.DOWNLOADS).iterdir())


def test_a_second_fetch_of_a_dataset_waits_for_the_first_and_fetches_nothing_again(world, tmp_path):
    """Two fetches into one datasets/ folder (two shells, nodes on a shared file system): the second says who holds
    the dataset's lock, waits, then finds it present and downloads nothing of it."""
    import subprocess
    import sys

    root = project_root(tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", f"""
import sys
from pathlib import Path
from clipfinetune.project import data
d = data.load_manifest({str(world["manifest_path"])!r})["coco_val2017"]
with data.fetch_lock(d, Path({str(root)!r})):
    print("held", flush=True)
    sys.stdin.read()                                  # until the test has seen the other fetch wait
    data.fetch_dataset(d, Path({str(root)!r}), {world["url"]!r})
"""], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    world["server"].requests.clear()
    env = {**os.environ, data.MIRROR_ENV: world["url"], data.MANIFEST_ENV: str(world["manifest_path"])}
    second = subprocess.Popen(["clipfinetune", "data", PAPER, "--fetch"], cwd=root, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    waited = []
    for line in second.stderr:                        # the second fetch reaches coco_val2017 and waits
        if "coco_val2017: being fetched by pid" in line:
            waited.append(line)
            break
    holder.stdin.close()
    assert holder.wait(timeout=120) == 0
    out, _ = second.communicate(timeout=300)
    assert waited and f"pid {holder.pid} on " in waited[0], waited
    assert rows(out)["coco_val2017"] == "present"
    val2017 = [r for r in world["server"].requests if r[0].endswith("/zips/val2017.zip")]
    assert len(val2017) == 1                          # the holder's download only


def test_a_corrupt_archive_is_refused_by_name_and_complete_data_stays(world, tmp_path):
    bad = tmp_path / "bad-mirror"
    shutil.copytree(world["mirror"], bad)
    archive = bad / "images.cocodataset.org/zips/val2017.zip"
    raw = bytearray(archive.read_bytes())
    mid = len(raw) // 3
    raw[mid:mid + 64] = bytes(64)                                    # zeroed bytes inside a member
    archive.write_bytes(bytes(raw))
    root = tmp_path / "root"
    with serve(bad) as (url, _):
        data.fetch_dataset(_only(world, "karpathy"), root, url)
        with pytest.raises(data.FetchError) as e:
            data.fetch_dataset(_only(world, "coco_val2017"), root, url)
    assert e.value.dataset == "coco_val2017" and e.value.url.endswith("/images.cocodataset.org/zips/val2017.zip")
    assert "broken archive val2017.zip" in str(e.value)
    assert not (root / "datasets/coco/val2017").exists() or not any((root / "datasets/coco/val2017").iterdir())
    assert data.status(_only(world, "karpathy"), root).state == "present"
    assert not list((root / data.DOWNLOADS).iterdir())              # the broken download is not kept


def test_a_checksum_mismatch_and_a_404_name_the_dataset_and_the_url(world, tmp_path):
    d = _only(world, "karpathy")
    wrong = data.Dataset(**{**d.__dict__, "fetch": [{**d.fetch[0], "sha256": "0" * 64}]})
    with pytest.raises(data.FetchError, match=r"^karpathy: http://.*/cs\.stanford\.edu/people/karpathy/deepimagesent/"
                                              r"caption_datasets\.zip: checksum mismatch: sha256 [0-9a-f]{64}"):
        data.fetch_dataset(wrong, tmp_path, world["url"])
    assert not list((tmp_path / data.DOWNLOADS).iterdir()) and not (tmp_path / "datasets/karpathy").exists()
    # VALSE's pieces the miniature tree lacks are not on the mirror
    with pytest.raises(data.FetchError, match=r"^valse: http://.*/raw\.githubusercontent\.com/Heidelberg-NLP/VALSE/"
                                              r"main/data/plurals\.json: HTTP 404"):
        data.fetch_dataset(_only(world, "valse"), tmp_path, world["url"])


def test_a_full_disk_is_refused_before_the_download_naming_the_dataset_and_the_url(world, tmp_path, monkeypatch):
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(data.shutil, "disk_usage", lambda path: usage._replace(free=1000))
    d = _only(world, "coco_train2017")
    with pytest.raises(data.FetchError, match=r"^coco_train2017: http://127\.0\.0\.1:\d+/images\.cocodataset\.org/"
                                              r"zips/train2017\.zip: disk full: 1\.0 KB free under \S+, "
                                              r"about \d+\.\d KB needed \(archive \+ unpacked\)"):
        data.fetch_dataset(d, tmp_path, world["url"])
    assert not (tmp_path / data.DOWNLOADS).exists() or not list((tmp_path / data.DOWNLOADS).iterdir())


def test_the_space_needed_is_what_the_server_sends_not_the_manifests_size(world, tmp_path, monkeypatch):
    """A mirror of miniature archives fetches on a disk far smaller than the real dataset (19 GB)."""
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(data.shutil, "disk_usage", lambda path: usage._replace(free=10**6))
    d = _only(world, "coco_train2017")
    assert d.bytes > 10**9
    data.fetch_dataset(d, tmp_path, world["url"])
    assert data.status(d, tmp_path).state == "present"


def test_the_command_reports_a_failure_by_dataset_and_url_and_fetches_the_rest(world, tmp_path):
    root = project_root(tmp_path)
    proc = cli(world, root, "degla", "--fetch")                    # VALSE's pieces: 404 on the mirror
    assert proc.returncode == 1
    assert re.search(r"^FAILED valse: http://127\.0\.0\.1:\d+/raw\.githubusercontent\.com/Heidelberg-NLP/VALSE/main/"
                     r"data/\S+\.json: HTTP 404", proc.stdout, re.MULTILINE), proc.stdout
    assert rows(proc.stdout)["sugarcrepe"] == "present" and rows(proc.stdout)["blip_flickr_test"] == "present"


# ------------------------------------------------------------------------------------------------ the plan
def test_the_plans_missing_inputs_are_grouped_by_dataset_with_the_command_that_fetches_them(tmp_path):
    from clipfinetune.project import plan

    params = profile.layered(yaml.safe_load(committed("params.yaml")), profile.load_plain(ROOT / "params.real.yaml"),
                             profile.load_plain(ROOT / "recipes" / f"{PAPER}.yaml"))
    p = plan.make_plan(params, tmp_path, plan.Hardware(1, 1, "NVIDIA H200"), stages=[], timeout=0.5)
    missing = [r for r in p["refusals"] if r["message"].startswith("missing data")]
    by_dataset = {re.match(r"missing data: (\S+)", r["message"]).group(1): r for r in missing}
    assert set(by_dataset) == {"coco_train2017", "coco_val2017", "coco_annotations_2017", "coco_panoptic_val2017",
                               "karpathy", "flickr30k", "coco_train2014", "coco_annotations_2014", "docci"}
    assert by_dataset["coco_val2017"]["fixes"] == ["clipfinetune data --fetch"]
    assert "eval.evalsets.retrieval.real.images" in by_dataset["coco_val2017"]["param"]
    assert by_dataset["flickr30k"]["fixes"][0].startswith("manual: https://shannon.cs.illinois.edu/")
    text = plan.render(p)
    assert "missing data, by dataset" in text and text.count("clipfinetune data --fetch") >= 1


# ------------------------------------------------------------------------------------------------ README
def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Real data and the papers", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL).group(1)
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.split("#", 1)[0].strip()]


def test_readmes_real_data_path_is_four_commands():
    """The four commands as the README writes them; tests/scale/test_data_fetch_repro.py runs them, as written, on
    the miniature mirror."""
    commands = readme_commands()
    assert [c.split()[:2] for c in commands] == [["clipfinetune", "recipe"], ["clipfinetune", "data"],
                                                 ["clipfinetune", "plan"], ["dvc", "exp"]]
    assert commands[0] == f"clipfinetune recipe {PAPER}" and commands[3] == f"dvc exp run -n {PAPER}"
