"""Root conftest: loads the shared inferbus fixtures for every test in the repo.

The fixtures (``nats_server``, ``redis_server``, ``s3_server``, ``s3_bucket``,
``nats_client``, ``tmp_state``, ``spawn_service``) live in the
``inferbus-testing`` workspace package, `inferbus_testing.fixtures`.
"""

pytest_plugins = ["inferbus_testing.fixtures"]
