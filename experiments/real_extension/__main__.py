"""``python -m experiments.real_extension``: the experiment's stages (cli.py)."""

from .cli import main

if __name__ == "__main__":
    main()
