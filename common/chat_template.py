"""`--chat-template FILE|STRING`, read as vLLM reads it: a file's contents, else the template itself."""
from __future__ import annotations

from pathlib import Path

_TEMPLATE_CHARS = set("{}\n")     # a Jinja template has these; a path (almost) never does


def load_chat_template(value: str) -> str:
    """The Jinja text. A value that is no file and has none of a template's characters is a missing file,
    reported as one rather than served as a one-line template."""
    path = Path(value).expanduser()
    try:
        if path.is_file():
            return _checked(path.read_text())
    except OSError as e:          # a name too long for a path is a template
        if not _TEMPLATE_CHARS & set(value):
            raise ValueError(f"cannot read {value!r}: {e}") from None
    if _TEMPLATE_CHARS & set(value):
        return _checked(value)
    raise ValueError(f"{value!r} is neither a file nor a Jinja template")


def _checked(text: str) -> str:
    """Syntax errors surface at start-up, not on the first chat request."""
    import jinja2
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse: {e} (line {e.lineno})") from None
    return text
