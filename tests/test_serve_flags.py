"""llama-server's serve flags (cli/serve_flags.py, server/listen.py): what each sets, and one clear line and
exit code 1 for each bad value, before anything is loaded."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from specserve.cli import build_parser, main
from specserve.cli.serve import api_keys, server_settings
from specserve.errors import SpecserveError
from specserve.gguf.chat_template import render_chat
from specserve.gguf.template_names import BUILTIN_TEMPLATES, resolve_chat_template
from specserve.server import listen

NO_MODEL = ["-m", "/nonexistent/model.gguf"]


def settings(*flags: str):
    return server_settings(build_parser().parse_args(["serve", *NO_MODEL, *flags]))


def test_accepted_flags_and_what_they_set(caplog: pytest.LogCaptureFixture) -> None:
    s = settings()
    assert (s.mmap, s.endpoint_slots, s.chat_template, s.tags) == (True, True, None, [])
    assert settings("--no-mmap").mmap is False
    assert settings("-dio").mmap is False and settings("--direct-io", "--no-direct-io").mmap is True
    assert settings("--no-slots").endpoint_slots is False and settings("--no-slots", "--slots").endpoint_slots
    assert settings().webui and settings("--no-webui").webui is False and settings("--no-ui").webui is False
    assert settings().endpoint_metrics is False and settings("--metrics").endpoint_metrics
    assert settings("--draft-policy", "gated").chain_drafts is False and settings().chain_drafts
    assert settings("--spec-shared-tokens", "0").spec_shared_tokens == 0
    assert settings("--context-shift").context_shift and not settings("--no-context-shift").context_shift
    assert settings("--tags", "a, b,,c").tags == ["a", "b", "c"]
    assert settings("-a", "x,y").alias == "x,y"
    assert settings("--chat-template", "chatml").chat_template == BUILTIN_TEMPLATES["chatml"]
    for accepted in (["-kvu"], ["--no-kv-unified"], ["--jinja"], ["--no-jinja"],
                     ["--no-context-shift"]):
        settings(*accepted)
    with caplog.at_level("WARNING"):
        settings("-md", "/nonexistent/draft.gguf", "--spec-replace", "<a>", "<b>")
    assert "--spec-replace has no effect" in caplog.text


def test_boolean_flags_read_llama_servers_env_vars(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value, field, expected in [("LLAMA_ARG_MMAP", "off", "mmap", False),
                                         ("LLAMA_ARG_DIO", "1", "mmap", False),
                                         ("LLAMA_ARG_ENDPOINT_SLOTS", "disabled", "endpoint_slots", False),
                                         ("LLAMA_ARG_ENDPOINT_METRICS", "1", "endpoint_metrics", True),
                                         ("LLAMA_ARG_ENDPOINT_SLOTS", "true", "endpoint_slots", True)]:
        monkeypatch.setenv(name, value)
        assert getattr(settings(), field) is expected, name
        monkeypatch.delenv(name)
    monkeypatch.setenv("LLAMA_ARG_CHAT_TEMPLATE", "zephyr")
    monkeypatch.setenv("LLAMA_ARG_TAGS", "t")
    s = settings("--no-mmap")
    assert s.chat_template == BUILTIN_TEMPLATES["zephyr"] and s.tags == ["t"] and s.mmap is False


def test_chat_template_file(tmp_path: Path) -> None:
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    assert settings("--chat-template-file", str(f)).chat_template == f.read_text()


@pytest.mark.parametrize("name", list(BUILTIN_TEMPLATES))
def test_builtin_templates_render(name: str) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    template = resolve_chat_template(name, None) or ""
    text, without = (render_chat(template, messages, add_generation_prompt=g, bos_token="<s>", eos_token="</s>")
                     for g in (True, False))
    assert text.index("Be brief.") < text.index("Hi there") < text.index("Hello") < text.index("Bye")
    assert text.startswith(without) and (len(text) > len(without) or name == "llama2")  # llama2: no header


@pytest.mark.parametrize(("flags", "env", "needle"), [
    (["--chat-template", "no-such-template"], {}, "unknown chat template 'no-such-template'"),
    (["--api-key-file", "/nonexistent/keys"], {}, "--api-key-file /nonexistent/keys: No such file"),
    (["--chat-template", "{% if %}"], {}, "chat template syntax error"),
    (["--chat-template", "chatml", "--chat-template-file", "x"], {}, "not both"),
    (["--chat-template-file", "/nonexistent/t.jinja"], {}, "cannot read --chat-template-file"),
    (["--host", "127.0.0.1,,::1"], {}, "--host"),
    (["--host", "127.0.0.1,127.0.0.1"], {}, "names an address twice"),
    (["--host", "no-such-host.invalid"], {}, "cannot listen on no-such-host.invalid"),
    ([], {"LLAMA_ARG_MMAP": "maybe"}, "LLAMA_ARG_MMAP='maybe' is not a boolean"),
    ([], {"LLAMA_ARG_ENDPOINT_SLOTS": "2"}, "LLAMA_ARG_ENDPOINT_SLOTS"),
])
def test_bad_values_are_one_line(flags: list[str], env: dict[str, str], needle: str,
                                 monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(["serve", *NO_MODEL, *flags]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and err.count("\n") == 1, err


def test_a_port_in_use_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert main(["serve", *NO_MODEL, "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert err == f"error: cannot listen on 127.0.0.1 port {port}: Address already in use\n", err


def _accepts(sock: socket.socket) -> bool:
    family, addr = sock.family, sock.getsockname()
    with socket.socket(family, socket.SOCK_STREAM) as c:
        c.settimeout(5)
        c.connect(addr if family == socket.AF_UNIX else addr[:2])
        conn, _ = sock.accept()
        conn.close()
    return True


def test_listening_on_several_addresses_and_a_unix_socket(tmp_path: Path) -> None:
    hosts = ["127.0.0.1", str(tmp_path / "specserve.sock")]
    if socket.has_ipv6:
        try:
            socket.create_server(("::1", 0), family=socket.AF_INET6).close()
            hosts.insert(1, "::1")
        except OSError:
            pass  # no IPv6 loopback here
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    sockets = listen.bind(listen.parse_hosts(",".join(hosts)), port)
    try:
        assert len(sockets) == len(hosts) and all(_accepts(s) for s in sockets)
        assert listen.urls(hosts, port)[0] == f"http://127.0.0.1:{port}" and listen.urls(hosts, port)[-1].startswith(
            "unix:")
        with pytest.raises(SpecserveError, match="cannot listen on 127.0.0.1"):
            listen.bind(["127.0.0.1"], port)  # taken now
    finally:
        for s in sockets:
            s.close()


def test_api_keys_from_the_flag_and_a_file(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# team a\nkey-a\n\n  key-b  \n#key-c\n")
    args = build_parser().parse_args(["serve", "--api-key", "key-0", "--api-key-file", str(keys)])
    assert api_keys(args) == "key-0,key-a,key-b"
    assert api_keys(build_parser().parse_args(["serve"])) is None
