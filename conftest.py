"""Root conftest: loads the shared inferbus fixtures for every test in the repo.

The fixtures (``nats_server``, ``redis_server``, ``s3_server``, ``s3_bucket``,
``nats_client``, ``tmp_state``, ``spawn_service``) live in the
``inferbus-testing`` workspace package, `inferbus_testing.fixtures`.
"""

import os

# Tests start service processes (fork + exec) while gRPC client threads run in
# this process. gRPC's fork handlers then sometimes crash the child before it
# execs (SIGSEGV in subprocess._execute_child, seen in CI as a service "exited
# with code -11 during start-up"). Nothing uses gRPC in a forked child, so turn
# the handlers off; gRPC reads this when it is first imported, so it must be set
# before any test module or plugin imports grpc.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

pytest_plugins = ["inferbus_testing.fixtures"]
