"""python -m minidist.checkpoint show|verify|export|import ... (minidist/checkpoint/cli.py)."""
import sys

from minidist.checkpoint.cli import main

sys.exit(main())
