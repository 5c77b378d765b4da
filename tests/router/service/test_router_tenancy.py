"""Tenancy: the cache_salt comes from server-side metadata, never blindly from the body."""

import pytest

from kvroute_proto.events import Partition
from router.service.tenancy import (
    MAX_TENANT_ID_BYTES,
    TenancyConfig,
    TenancyError,
    resolve_partition,
    salt_for_tenant,
    tenant_id_from_metadata,
)

MD_A = (("x-tenant-id", "acme"), ("other", "x"))
MD_B = (("x-tenant-id", "globex"),)


def test_body_salt_is_ignored_and_tenant_salt_overwrites_it():
    cfg = TenancyConfig()
    p = resolve_partition(cfg, MD_A, Partition(cache_salt="globex-forged", extra_key="lora1"))
    assert p == Partition("tenant:acme", "lora1")


def test_anonymous_caller_gets_default_salt_even_when_body_claims_one():
    cfg = TenancyConfig()
    assert resolve_partition(cfg, (), Partition("tenant:acme")) == Partition("", "")
    assert resolve_partition(cfg, None, Partition("x", "k")) == Partition("", "k")


def test_hmac_salt_is_unguessable_deterministic_and_per_tenant():
    cfg = TenancyConfig(salt_secret=b"s3cret")
    a1 = resolve_partition(cfg, MD_A, Partition()).cache_salt
    a2 = resolve_partition(cfg, MD_A, Partition()).cache_salt
    b = resolve_partition(cfg, MD_B, Partition()).cache_salt
    assert a1 == a2 and a1 != b
    assert "acme" not in a1 and a1.startswith("t:") and len(a1) == 2 + 32
    other_secret = salt_for_tenant(TenancyConfig(salt_secret=b"other"), "acme")
    assert other_secret != a1


def test_trust_client_salt_uses_non_empty_body_salt_only():
    cfg = TenancyConfig(trust_client_salt=True)
    assert resolve_partition(cfg, MD_A, Partition("mine", "k")) == Partition("mine", "k")
    assert resolve_partition(cfg, MD_A, Partition("", "k")) == Partition("tenant:acme", "k")


def test_tenancy_off_with_empty_header():
    cfg = TenancyConfig(tenant_header="")
    assert tenant_id_from_metadata(cfg, MD_A) == ""
    assert resolve_partition(cfg, MD_A, Partition("forged")) == Partition()


def test_bytes_metadata_and_case_insensitive_key():
    cfg = TenancyConfig()
    assert tenant_id_from_metadata(cfg, (("X-Tenant-Id", b"acme"),)) == "acme"


def test_limits_name_field_and_limit():
    cfg = TenancyConfig()
    with pytest.raises(TenancyError, match=f"x-tenant-id must be at most {MAX_TENANT_ID_BYTES}"):
        tenant_id_from_metadata(cfg, (("x-tenant-id", "a" * 300),))
    with pytest.raises(TenancyError, match=r"partition\.extra_key must be at most 256"):
        resolve_partition(cfg, (), Partition("", "k" * 257))
    with pytest.raises(TenancyError, match=r"partition\.cache_salt must be at most 256"):
        resolve_partition(TenancyConfig(trust_client_salt=True), (), Partition("s" * 257))


def test_config_validation():
    with pytest.raises(TenancyError, match="lowercase"):
        TenancyConfig(tenant_header="X-Tenant")
    with pytest.raises(TenancyError, match="salt_secret"):
        TenancyConfig(salt_secret=b"")
