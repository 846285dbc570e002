import sys

from psserver.serve.server import main

sys.exit(main())
