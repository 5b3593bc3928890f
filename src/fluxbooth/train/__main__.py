import sys

from fluxbooth.train.main import main

sys.exit(main())
