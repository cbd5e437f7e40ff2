"""Shared fixtures: Ray is started once per test session, and only by the tests that need it."""

import logging

import pytest


@pytest.fixture(scope="session")
def ray_session():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    yield ray
    ray.shutdown()
