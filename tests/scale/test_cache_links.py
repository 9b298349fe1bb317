"""The project's DVC cache links outputs instead of copying them (.dvc/config cache.type hardlink,symlink):
an output is the cache file itself, one inode, protected read-only,
so it is stored once. Runs `dvc repro sample` on the tiny world in a throw-away copy (a minute)."""
from __future__ import annotations

import stat

from fixtures.project import TINY, copy_project, run, write_params


def test_an_output_is_its_cache_file_not_a_copy(tmp_path):
    repo = copy_project(tmp_path / "project", link_cache=True)
    write_params(repo, {"sample": TINY["sample"]})
    run(repo, "git", "init", "-q")
    run(repo, "git", "add", "-A")
    run(repo, "git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "links")
    run(repo, "dvc", "repro", "sample")
    out = repo / "data" / "sample" / "karpathy" / "dataset_coco.json"        # a file of a folder output
    cache = {p.stat().st_ino for p in (repo / ".dvc" / "cache" / "files" / "md5").rglob("*") if p.is_file()}
    st = out.stat()                                              # a symlink: its target in the cache
    assert st.st_ino in cache and (out.is_symlink() or st.st_nlink == 2)
    assert stat.S_IMODE(st.st_mode) & 0o222 == 0                 # read-only: an edit in place fails, never the cache
