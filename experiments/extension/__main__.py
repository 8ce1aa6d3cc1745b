"""``python -m experiments.extension``: the experiment's five stages (pipeline.py)."""

from .pipeline import main

if __name__ == "__main__":
    main()
