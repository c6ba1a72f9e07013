"""A --reward whose worker takes 1.5 s to start (its import sleeps), longer than tests/unit/test_user_options.py's 1 s
limit: a check sent to a worker restarted after a timeout must still get its whole limit."""

import time

time.sleep(1.5)


def slow(completion_text, problem):
    time.sleep(60 if completion_text == "slow" else 0)
    return 1.0
