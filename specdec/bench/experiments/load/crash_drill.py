import asyncio, argparse, json
from specdec.launcher import DEFAULT_MODEL_REPOSITORY, TritonServer, free_ports
from loadtest.soak import crash_drill
http, grpc, metrics = free_ports(3)
server = TritonServer()
server.start(DEFAULT_MODEL_REPOSITORY, http_port=http, grpc_port=grpc, metrics_port=metrics)
try:
    server.wait_ready(timeout=600)
    args = argparse.Namespace(protocol="http", drill_timeout_s=60)
    print(json.dumps(asyncio.run(crash_drill(server, "Write a long story about the sea.", args)), indent=1))
finally:
    server.stop()
