import sys

from psserver.server import main

sys.exit(main())
