"""Apply a porting diff as docs/own-loop.md writes it to a script's lines.

The diff's hunks are separated by blank lines. In a hunk, ' ' lines are kept and '-' lines removed,
each found in the script in order (a hunk's first line anywhere after the previous hunk, the
others on the lines that follow); '+' lines are added where they stand; a line `...` leaves out
lines: unchanged ones after ' ' (`     ...`), removed ones after '-' (`-    ...`)."""

from __future__ import annotations


def diff_block(markdown: str, section: str) -> list[str]:
    """The lines of the first ```diff block after the heading `section`."""
    text = markdown.split(section, 1)[1]
    start = text.index("```diff\n") + len("```diff\n")
    return text[start : text.index("```", start)].splitlines()


def apply(script: list[str], diff: list[str]) -> list[str]:
    out, at = [], 0  # the new script so far; the next line of `script` not yet copied
    for hunk in _hunks(diff):
        first, gap = True, None
        for line in hunk:
            tag, text = line[:1], line[1:]
            if tag == "+":
                out.append(text)
                continue
            if text.strip() == "...":
                gap = tag
                continue
            found = at
            while found < len(script) and script[found].rstrip() != text.rstrip():
                if not first and gap is None:
                    raise ValueError(
                        f"the diff's line {text.strip()!r} is not where the diff puts it (line {found + 1})"
                    )
                found += 1
            if found == len(script):
                raise ValueError(f"the diff's line {text.strip()!r} is not in the script")
            if first or gap == " ":
                out.extend(script[at:found])  # before the hunk, or left out unchanged
            at = found + 1
            if tag == " ":
                out.append(script[found])
            first, gap = False, None
    return out + script[at:]


def _hunks(diff: list[str]) -> list[list[str]]:
    hunks, current = [], []
    for line in diff:
        if line.strip():
            current.append(line)
        elif current:
            hunks.append(current)
            current = []
    return hunks + ([current] if current else [])
