import sys

from psworker.worker import main

sys.exit(main())
