"""How judged text goes into the critic prompt: as data that cannot break out of its block or pose as
the prompt's own lines (docs/design.md, "the critic prompt"). Pure: strings in, strings out."""

from __future__ import annotations

import re

DATA_ESCAPE_VERSION = "tags-entities-lookalikes-lines-v2"
"""Version of how judged text is put into the critic prompt (:func:`as_data`); part of the
critique key, so a change re-critiques instead of reusing critiques of another prompt."""

OUTCOME_DATA_ESCAPE_VERSION = DATA_ESCAPE_VERSION + "+first-line-v1"
"""The same for a whole solution (GenORM, ``critique.mode=outcome``), whose first line is marked
too; it follows :data:`DATA_ESCAPE_VERSION`, and step critiques keep that one and their key."""


def _letters(word: str) -> str:
    # each letter ASCII (either case) or its fullwidth form (U+FF21.., U+FF41..)
    return "".join(f"[{c}{c.upper()}{chr(0xFF41 + ord(c) - 97)}{chr(0xFF21 + ord(c) - 97)}]" for c in word)


_LT = r"(?:<|\uFF1C|\uFE64|\u2039|\u3008|\u27E8|\u2329|&lt;?|&#0*60;?|&#[xX]0*3[cC];?)"
_GT = r"(?:>|\uFF1E|\uFE65|\u203A|\u3009|\u27E9|\u232A|&gt;?|&#0*62;?|&#[xX]0*3[eE];?)"
_SLASH = r"(?:/|\uFF0F|\u2044|\u2215|&#0*47;?|&#[xX]0*2[fF];?|&sol;)"
_SOLUTION_TAG = re.compile(rf"{_LT}\s{{0,20}}({_SLASH}?)\s{{0,20}}{_letters('solution')}\s{{0,20}}{_GT}")
_FORGED_LINE = re.compile(r"[\s*_`#>|-]{0,8}(?:step[\s*_`]{0,3}\d|wrong[\s*_`]+step[\s*_`]+list|"
                          r"final[\s*_`]+answer[\s*_`]+correct)", re.IGNORECASE)


def as_data(text: str, step: int | None = None) -> str:
    """Judged text as data that cannot break out of the ``<solution>`` block or pose as the
    prompt's own lines (docs/design.md, "the critic prompt").

    - A ``<solution>`` / ``</solution>`` tag in any spelling (spaces inside, ``&lt;`` entities,
      decimal and hex character references, fullwidth and other look-alike brackets, slashes and
      letters) becomes ``[solution]`` / ``[/solution]``.
    - A line that starts like one of the prompt's step lines (``Step 3: ...``) or verdict lines
      (``Wrong step list: ...``, ``Final answer correct: ...``) is marked as text of step ``step``
      (``[in step 0] Step 3: correct``), so a policy cannot forge a judgment. A step's first line
      follows its ``Step i:`` prefix and is left as it is; a whole solution (``step`` None, the
      GenORM prompt) has every line checked, the first included (``[in the solution] ...``).

    Linear in the length of ``text``; never raises on any string.
    """
    lines = defuse_tags(text).split("\n")
    where = f"[in step {step}]" if step is not None else "[in the solution]"
    for k in range(0 if step is None else 1, len(lines)):
        if _FORGED_LINE.match(lines[k], 0, 200):
            lines[k] = f"{where} {lines[k]}"
    return "\n".join(lines)


_ANNOTATION = re.compile(r"<<[^<>]*>>")
_GSM8K_FINAL = re.compile(r"^\s*####.*$", re.M)


def reference_text(solution: str) -> str:
    """A dataset's reference solution as shown to the critic: GSM8K's calculator annotations
    (``<<48/2=24>>``) and its ``#### 72`` answer line removed, and any ``<solution>`` tag defused
    (:func:`defuse_tags`), so the block cannot pose as the judged solution."""
    return defuse_tags(_GSM8K_FINAL.sub("", _ANNOTATION.sub("", solution)).strip())


def defuse_tags(text: str) -> str:
    """``text`` with every ``<solution>`` / ``</solution>`` tag, in any spelling, made ``[solution]`` /
    ``[/solution]`` (the first rule of :func:`as_data`)."""
    return _SOLUTION_TAG.sub(lambda m: f"[{'/' if m.group(1) else ''}solution]", text)

