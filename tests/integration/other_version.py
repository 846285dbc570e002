"""A task or client that speaks another protocol version (test_versions.py):

    python -m tests.integration.other_version VERSION psserver|psworker [task args...]
    python -m tests.integration.other_version VERSION client ADDRESS

sets ``psserver.contract.PROTOCOL_VERSION`` before anything else reads it,
as a build of that version would have it, then runs the task, or asks
ADDRESS for its ServerInfo and prints ``refused <error type>: <message>``
or ``answered``.
"""
import sys

import psserver.contract

psserver.contract.PROTOCOL_VERSION = int(sys.argv[1])
role, rest = sys.argv[2], sys.argv[3:]
if role == "client":
    from psserver.client import PSClient
    from psserver.errors import PSError
    try:
        with PSClient(rest[0], timeout=20) as c:
            c.server_info()
        print("answered")
    except PSError as exc:
        print(f"refused {type(exc).__name__}: {exc}")
    sys.exit(0)
sys.argv = [role, *rest]
if role == "psserver":
    from psserver.serve.server import main
else:
    from psworker.worker import main
sys.exit(main())
