"""Redis URLs against a real password-protected redis-server: the client's own options pass through, unknown or
misplaced ones and missing TLS files are one-line errors (never a TypeError at the first command), a password works
percent-encoded or as ``?password=`` and never shows; config values of the wrong type are one line too."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

import pytest
from store_helpers import make_segment, redis_server

from kvforge.cli import main
from kvforge.errors import StoreUnavailableError, UserError
from kvforge.store import open_store
from kvforge.store.codec import segments_equal

PASSWORD = "Qz#?/,@Xk9J"  # every character a URL cuts at


@pytest.fixture(scope="module")
def protected(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    with redis_server(tmp_path_factory.mktemp("redis"), password=PASSWORD) as url:
        yield url.removeprefix("redis://").removesuffix("/0")  # host:port


def test_password_percent_encoded_or_as_a_query_value(protected: str) -> None:
    encoded = quote(PASSWORD, safe="")
    for url in (
        f"redis://:{encoded}@{protected}/0",
        f"redis://{protected}/0?password={quote(PASSWORD)}",
        f"redis://default:{encoded}@{protected}/0?client_name=kvf&health_check_interval=5",
    ):
        store = open_store(url)
        store.put("aa", make_segment())
        assert segments_equal(store.get("aa"), make_segment())
        assert PASSWORD not in repr(store) + str(store.stats()) and quote(PASSWORD, safe="") not in str(store.stats())


@pytest.mark.parametrize("password", ["wrong-one", PASSWORD.replace("#", "%23")[:5]])
def test_a_wrong_password_is_one_line_without_it(protected: str, password: str, capsys) -> None:  # type: ignore[no-untyped-def]
    url = f"redis://:{password}@{protected}/0"
    with pytest.raises(StoreUnavailableError) as e:
        open_store(url)
    assert password not in str(e.value) and "\n" not in str(e.value)
    assert main(["cache", "stats", "--store", url]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and password not in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("ssl_cert_reqs=required", r"needs rediss:// \(TLS\)"),
        ("ssl_keyfile=/etc/hostname", r"needs rediss:// \(TLS\)"),
        ("socket_timout=3", "unknown option 'socket_timout'"),
        ("PASSWORD=x", "unknown option 'PASSWORD'"),
        ("health_check_interval=soon", "Invalid value for 'health_check_interval'"),
    ],
)
def test_client_options_on_a_plain_url(protected: str, query: str, message: str, capsys) -> None:  # type: ignore[no-untyped-def]
    url = f"redis://:{quote(PASSWORD, safe='')}@{protected}/0?{query}"
    with pytest.raises(UserError, match=message):
        open_store(url)
    assert main(["cache", "ls", "--store", url]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "Qz#" not in err and "Qz%23" not in err


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("ssl_keyfile=/no/such.key&ssl_certfile=/no/such.crt", "no such file"),
        ("ssl_keyfile=/etc/hostname", "needs ssl_certfile"),
        ("ssl_ca_certs=/no/such.pem", "no such file"),
        ("ssl_cert_reqs=bogus", "bad store URL"),
    ],
)
def test_tls_options_are_checked_before_connecting(protected: str, query: str, message: str) -> None:
    with pytest.raises(UserError, match=message) as e:
        open_store(f"rediss://:{quote(PASSWORD, safe='')}@{protected}/0?{query}")
    assert "\n" not in str(e.value) and "Qz#" not in str(e.value)


def test_tls_against_a_plain_server_is_unavailable_in_one_line(protected: str) -> None:
    with pytest.raises(StoreUnavailableError) as e:
        open_store(f"rediss://:{quote(PASSWORD, safe='')}@{protected}/0?ssl_cert_reqs=none&connect_timeout=0.5")
    assert "\n" not in str(e.value) and "Qz" not in str(e.value)


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("store = 5", "config store: expected a string, got 5 (an integer): quote it"),
        ("store = true", "config store: expected a string"),
        ('[cache.ls]\nstore = ["redis://:Qz#?/,@Xk9J@h/0"]', "config store: expected a string, got ['redis://***"),
        ("[generate]\nmax-new-tokens = [3]", "config max-new-tokens: expected an integer >= 1"),
        ('[generate]\nmax-new-tokens = "many"', "config max-new-tokens"),
    ],
)
def test_config_values_of_the_wrong_type_are_one_line(tmp_path: Path, toml: str, message: str, capsys) -> None:  # type: ignore[no-untyped-def]
    config = tmp_path / "kvforge.toml"
    config.write_text(toml + "\n")
    assert main(["--config", str(config), "cache", "ls"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
