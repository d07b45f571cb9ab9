"""The one test harness every suite uses: real redis-servers (fleet, secure_redis, sentinels),
worker and gateway processes (fleet, gateway), the tiny models (models), the offline oracle
(oracle), engine helpers (engine) and the writer's (writer). It imports nothing itself, so a
suite that needs only the tiny models (the GPU suite, on a machine without redis) imports just
those."""
