"""`clipfinetune <command>`: the project's command line (pyproject.toml [project.scripts]).

    clipfinetune recipe <paper>     params.yaml for one paper's protocol (clipfinetune/project/profile.py)
    clipfinetune data [<paper>]     the datasets it reads, present or not; --fetch downloads them
                                    (clipfinetune/project/data.py)
    clipfinetune plan               what `dvc repro` would run with the applied params, checked before any work
                                    (clipfinetune/project/plan/)

Each command is also its module's own `python -m clipfinetune.project.<module>`.
"""
from __future__ import annotations

import importlib
import sys

# command -> module with main(argv)
COMMANDS = {"recipe": "clipfinetune.project.profile", "plan": "clipfinetune.project.plan",
            "data": "clipfinetune.project.data"}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(__doc__.strip(), file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    command, rest = argv[0], argv[1:]
    if command == "recipe":
        from clipfinetune.project import profile

        return profile.main(["recipe", *rest], prog="clipfinetune")
    return importlib.import_module(COMMANDS[command]).main(rest)


if __name__ == "__main__":
    sys.exit(main())
