"""`python -m batchrun job=summarize`: see batchrun/cli.py."""

import logging
import os
import sys

from batchrun.cli import main
from batchrun.job.status import main as status_main

if __name__ == "__main__":
    if sys.argv[1:2] == ["status"]:
        # `status` only reads and prints. Its process has been seen to abort (SIGABRT, "terminate
        # called without an active exception") after printing, in a native library's teardown at
        # interpreter exit, which turns a correct answer into exit code 134 for the scripts that
        # poll it. Nothing it opened needs closing, so it leaves without that teardown.
        code = status_main(sys.argv[2:])
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    main()
