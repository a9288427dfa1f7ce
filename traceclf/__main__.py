"""``python -m traceclf`` and the ``traceclf`` console script: the CLI's :func:`main`, ended at
once where it stops while a read still runs on another thread (:func:`exit_past_reads`)."""

from traceclf.cli import main
from traceclf.support.process import exit_past_reads


def entry() -> None:
    exit_past_reads(main)


if __name__ == "__main__":
    entry()
