"""python -m clipfinetune.project.plan: `clipfinetune plan`."""
import sys

from clipfinetune.project.plan import main

sys.exit(main())
