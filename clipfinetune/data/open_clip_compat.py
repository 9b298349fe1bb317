"""Run `open_clip_train.main` on our shards with webdataset >= 0.2.96 (we pin 1.0.x).

open_clip_train 3.3.0's `tarfile_to_samples_nothrow` feeds webdataset's `tar_file_expander` into its own
`group_by_keys_nothrow`, which cannot digest the end-of-shard marker (`eof_value={}`) that webdataset
yields since 0.2.96: every webdataset run dies with `KeyError: 'fname'` at the end of the first shard
(mlfoundations/open_clip#935, webdataset/webdataset#384; the fix proposed there is `eof_value=None`).
`patch()` applies exactly that fix to the imported module; nothing else changes.

    python -m clipfinetune.data.open_clip_compat --dataset-type webdataset --train-data ... (open_clip flags)
"""
from __future__ import annotations

import functools
import sys


def patch() -> None:
    import open_clip_train.data as oc_data
    from webdataset.tariterators import tar_file_expander

    if not getattr(oc_data.tar_file_expander, "_cft_patched", False):
        fixed = functools.partial(tar_file_expander, eof_value=None)
        fixed._cft_patched = True
        oc_data.tar_file_expander = fixed


def main(argv: list[str] | None = None) -> None:
    patch()
    from open_clip_train.main import main as open_clip_main

    open_clip_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
