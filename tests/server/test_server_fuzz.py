"""Schemathesis against a real `python -m tandem.server` (the shared session server, API key on):
zero server errors, zero responses that break the server's own OpenAPI schema."""
import httpx
import pytest

from conftest import API_KEY
from tests.api_fuzz import fuzz

pytestmark = pytest.mark.slow
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_schemathesis_server(server):
    schema = httpx.get(f"{server.url}/openapi.json", headers=AUTH).json()
    calls = fuzz(schema, server.url, AUTH, max_examples=40, time_budget_s=150)
    assert calls > 50
    assert httpx.get(f"{server.url}/health").status_code == 200  # still serving
