"""Sources as configuration: every stage that reads a source declares it (params `sources.<name>`, or `sources` whole
for `shards`) and depends on each of its paths in dvc.yaml, so an edited corpus file re-runs what it feeds."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from fixtures.project import dvc_expanded_stages

from clipfinetune.data.readers import READERS, reader, source_paths
from clipfinetune.keys import lookup

ROOT = Path(__file__).resolve().parents[1]
PARAMS = yaml.safe_load((ROOT / "params.yaml").read_text())
# stage -> the params key naming the source(s) it reads
SOURCE_KEYS = {"pretrain": "pretrain.sources", "word_regions@coco": "word_regions.sources",
               "negatives@coco": "negatives.sources", "sentences@docci": "sentences.sources",
               "segments@docci": "segments.sources", "lism@docci": "lism.sources", "shards": "shards.sources"}

# source path keys a stage never opens: only word_regions reads COCO instances; the text-only stages no images
UNREAD = {"word_regions@coco": {"images"}, "negatives@coco": {"images", "instances"}, "sentences@docci": {"images"},
          "*": {"instances"}}


def _value(key: str):
    return lookup(PARAMS, key)


@pytest.fixture(scope="module")
def stages(tmp_path_factory) -> dict[str, dict]:
    """stage -> {"params": declared keys, "deps": dependency paths}, as DVC expands dvc.yaml."""
    return {name: {"params": set(s["params"]), "deps": set(s["deps"])}
            for name, s in dvc_expanded_stages(tmp_path_factory.mktemp("sources")).items()}


def test_every_source_names_a_known_reader_with_its_own_keys():
    for name, spec in PARAMS["sources"].items():
        assert spec["reader"] in READERS, name
        assert set(spec) - {"reader"} <= set(reader(spec["reader"]).KEYS), name


@pytest.mark.parametrize("stage", sorted(SOURCE_KEYS))
def test_a_stage_declares_the_sources_it_reads_and_depends_on_their_paths(stages, stage):
    names = _value(SOURCE_KEYS[stage])
    names = [names] if isinstance(names, str) else names
    declared, deps = stages[stage]["params"], stages[stage]["deps"]
    assert SOURCE_KEYS[stage] in declared
    for name in names:
        assert "sources" in declared or f"sources.{name}" in declared, (stage, name)
        spec = PARAMS["sources"][name]
        paths = set(source_paths(spec)) - {spec.get(k) for k in UNREAD.get(stage, UNREAD["*"])}
        assert paths <= deps, (stage, name, paths - deps)


def test_a_stage_declares_no_source_it_does_not_read(stages):
    for stage, keys in stages.items():
        listed = _value(SOURCE_KEYS[stage]) if stage in SOURCE_KEYS else []
        listed = {listed} if isinstance(listed, str) else set(listed)
        named = {k.split(".", 1)[1] for k in keys["params"] if k.startswith("sources.")}
        assert named <= listed, (stage, named - listed)
