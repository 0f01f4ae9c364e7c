"""`python -m batchrun job=summarize`: see batchrun/cli.py."""

from batchrun.cli import main

if __name__ == "__main__":
    main()
