import os
import sys

from fluxbooth.train.main import main

status = main()
# Every file is written and closed, every event printed: the interpreter's own teardown (torch's and
# DeepSpeed's exit handlers, freeing every object one by one) would only add seconds to every job.
sys.stdout.flush()
sys.stderr.flush()
os._exit(status)
