"""Griffe extension (mkdocs.yml, mkdocstrings' ``extensions``): the docstrings as written, rendered for a reader.

The package's docstrings are Google-style with Sphinx roles inside (``:meth:`at_boundary```), and its dataclass
fields carry their help in ``metadata={"help": ...}``. Nothing in the source changes; at render time this extension

* turns each role into a cross-reference: the target is resolved the way Sphinx would (a dotted path as written,
  else relative to the object's class, module and the packages above it, through imports and inherited
  members), and written as an *optional* autorefs reference, so it becomes a link where the target has an entry
  on the site and plain code where it has none (an external class, a private helper): ``mkdocs build --strict``
  never fails on a role. A target that does not resolve at all is written as plain code, and a role inside a
  code or literal block as the bare name;
* appends each dataclass field's ``metadata["help"]`` to the field's docstring and shows the field's default
  (``2e-05``), not the ``field(...)`` call;
* gives an ``Args:`` entry that documents several parameters at once (``critic, editor: ...``) their defaults
  (``None``) instead of "required".

tests/test_docs.py checks the result in the built site: no raw role, every public name in the search index.
"""

from __future__ import annotations

import ast
import html
import re
from typing import Any, Iterator, Optional

import griffe

_ROLE = re.compile(r":(?:py:)?(meth|class|func|attr|exc|mod|data|obj|const):`([^`]+)`")
_FENCE = re.compile(r"^\s*(```|~~~)")
# an Args line documenting several parameters at once: "a, b: ..." or "a / b (type): ..."
_GROUPED = re.compile(r"^\s+[A-Za-z_]\w*(?:\s*(?:,|/)\s*\*{0,2}[A-Za-z_]\w*)+\s*(?:\([^)]*\))?:\s", re.M)


def _plain(code: str) -> str:
    """A line of code or of a literal block with its roles as bare names (no markup renders there)."""
    return _ROLE.sub(lambda m: re.sub(r"^(.*?)\s*<[^>]+>$", r"\1", m.group(2)).lstrip("~!"), code)


def _walk(obj: griffe.Object) -> Iterator[griffe.Object]:
    """``obj`` and every object defined under it (aliases, i.e. imports and inherited members, skipped)."""
    yield obj
    for member in list(obj.members.values()):
        if not member.is_alias:
            yield from _walk(member)  # type: ignore[arg-type]


def _lookup(scope: griffe.Object, dotted: str) -> Optional[Any]:
    """The object ``scope.<dotted>`` (through imports and inherited members), or None."""
    obj: Any = scope
    for part in dotted.split("."):
        try:
            members = obj.all_members if obj.is_class else obj.members
            obj = members[part]
        except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError, AttributeError):
            return None
    return obj


def _identifier(found: Any) -> Optional[str]:
    """The autorefs identifier of a resolved target: an inherited member under the class it was reached through
    (where ``inherited_members`` renders it), anything else under its canonical path (mkdocstrings registers it)."""
    try:
        if found.is_alias and found.parent is not None and found.parent.is_class:
            return found.path
        return found.final_target.path if found.is_alias else found.path
    except (griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None


class SphinxRoles(griffe.Extension):
    """Cross-references for roles, field help for dataclass fields, defaults for grouped ``Args`` entries."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        self.collection = loader.modules_collection
        self.collection_lines = loader.lines_collection
        self.parser, self.parser_options = loader.docstring_parser, loader.docstring_options
        objects = list(_walk(pkg))
        for obj in objects:
            if obj.is_attribute:
                self._comment_docstring(obj)  # type: ignore[arg-type]
                self._field_help(obj)  # type: ignore[arg-type]
        for obj in objects:
            if obj.docstring is not None:
                obj.docstring.value = self._rewrite(obj.docstring.value, obj)
                if (obj.is_function or obj.is_class) and _GROUPED.search(obj.docstring.value):
                    self._grouped_defaults(obj)

    # ----- roles ------------------------------------------------------------------------------------------------
    def _resolve(self, target: str, owner: griffe.Object) -> Optional[str]:
        target = re.sub(r"\(.*\)$", "", target.strip().lstrip("~!.")).strip()
        if not re.fullmatch(r"[A-Za-z_][\w.]*", target):
            return None
        if target.split(".", 1)[0] == owner.path.split(".", 1)[0]:  # an absolute path in this package
            head, _, rest = target.partition(".")
            found = _lookup(self.collection[head], rest) if rest else self.collection[head]
            return _identifier(found) if found is not None else None
        scope: Optional[griffe.Object] = owner
        while scope is not None:
            if scope.is_class or scope.is_module:
                found = _lookup(scope, target)
                if found is not None:
                    return _identifier(found)
            scope = scope.parent
        return None

    def _role(self, match: re.Match[str], owner: griffe.Object) -> str:
        text = match.group(2)
        titled = re.fullmatch(r"(.*?)\s*<([^>]+)>", text, re.S)
        title, target = (titled.group(1), titled.group(2)) if titled else (text.lstrip("!"), text)
        if not titled and title.startswith("~"):
            title = title[1:].rsplit(".", 1)[-1]
        title = re.sub(r"\s*\n\s*", " ", title)
        identifier = self._resolve(target, owner)
        if identifier is None:
            return f"`{title}`"
        return f'<autoref identifier="{html.escape(identifier)}" optional>`{title}`</autoref>'

    def _rewrite(self, text: str, owner: griffe.Object) -> str:
        """``text`` with its roles replaced (a role may span two lines), outside fenced code, ``::`` literal
        blocks and ``>>>`` lines."""
        out: list[str] = []
        prose: list[str] = []  # the current run of lines where roles are rewritten
        fence: Optional[str] = None
        literal_indent: Optional[int] = None

        def flush() -> None:
            if prose:
                out.append(_ROLE.sub(lambda m: self._role(m, owner), "\n".join(prose)))
                prose.clear()

        for line in text.split("\n"):
            indent = len(line) - len(line.lstrip())
            if fence is not None:
                fence = None if line.strip().startswith(fence) else fence
                out.append(_plain(line))
                continue
            if literal_indent is not None:
                if not line.strip() or indent > literal_indent:
                    out.append(_plain(line))
                    continue
                literal_indent = None
            fenced = _FENCE.match(line)
            if fenced or line.lstrip().startswith(">>>"):
                flush()
                fence = fenced.group(1) if fenced else None
                out.append(_plain(line))
                continue
            prose.append(line)
            if line.rstrip().endswith("::"):
                flush()
                literal_indent = indent
        flush()
        return "\n".join(out)

    # ----- attributes documented by "#:" comments ------------------------------------------------------------------
    def _comment_docstring(self, attr: griffe.Attribute) -> None:
        """An attribute without a docstring gets its ``#:`` comment lines (the lines right above it, or a trailing
        ``#:`` on its own line) as its docstring, as Sphinx's autodoc reads them."""
        if attr.docstring is not None or not attr.lineno or attr.parent is None:
            return
        try:
            lines = self.collection_lines[attr.filepath]  # type: ignore[index]
        except (KeyError, AttributeError, griffe.BuiltinModuleError):
            return
        first = attr.lineno - 1  # 0-based index of the assignment's first line
        comment: list[str] = []
        i = first - 1
        while i >= 0 and lines[i].lstrip().startswith("#:"):
            comment.insert(0, lines[i].lstrip()[2:].strip())
            i -= 1
        if not comment and "#:" in lines[first]:
            comment = [lines[first].split("#:", 1)[1].strip()]
        if comment:
            attr.docstring = griffe.Docstring("\n".join(comment), parent=attr, lineno=attr.lineno, parser=self.parser,
                                              parser_options=self.parser_options)

    # ----- dataclass fields -------------------------------------------------------------------------------------
    def _field_help(self, attr: griffe.Attribute) -> None:
        """Append ``metadata["help"]`` to a dataclass field's docstring; show its default, not ``field(...)``."""
        if attr.parent is None or not attr.parent.is_class or attr.value is None:
            return
        try:
            call = ast.parse(str(attr.value), mode="eval").body
        except SyntaxError:
            return
        if not (isinstance(call, ast.Call) and ast.unparse(call.func) in ("field", "dataclasses.field")):
            return
        keywords = {k.arg: k.value for k in call.keywords if k.arg}
        if "default" in keywords:
            attr.value = ast.unparse(keywords["default"])
        elif "default_factory" in keywords:
            attr.value = f"{ast.unparse(keywords['default_factory'])}()"
        metadata = keywords.get("metadata")
        if not isinstance(metadata, ast.Dict):
            return
        for key, value in zip(metadata.keys, metadata.values):
            if isinstance(key, ast.Constant) and key.value == "help":
                text = self._string(value, attr.module)
                if attr.docstring is None:
                    attr.docstring = griffe.Docstring(text, parent=attr, parser=self.parser,
                                                      parser_options=self.parser_options)
                else:
                    attr.docstring.value = f"{attr.docstring.value}\n\n{text}"

    def _string(self, node: ast.expr, module: griffe.Module) -> str:
        """The text of a help string: a literal, or an f-string over the module's constants."""
        if isinstance(node, ast.Constant):
            return str(node.value)
        if isinstance(node, ast.JoinedStr):
            parts = []
            for part in node.values:
                if isinstance(part, ast.Constant):
                    parts.append(str(part.value))
                elif isinstance(part, ast.FormattedValue):
                    parts.append(self._constant(part.value, module))
            return "".join(parts)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return self._string(node.left, module) + self._string(node.right, module)
        return ast.unparse(node)

    def _constant(self, node: ast.expr, module: griffe.Module) -> str:
        name = ast.unparse(node)
        member = _lookup(module, name)
        try:
            return str(ast.literal_eval(str(member.value))) if member is not None and member.value is not None \
                else name
        except (ValueError, SyntaxError, griffe.AliasResolutionError):
            return name

    # ----- grouped Args entries ---------------------------------------------------------------------------------
    def _grouped_defaults(self, obj: griffe.Object) -> None:
        """Give an ``Args`` entry ``a, b: ...`` the defaults of ``a`` and ``b`` (griffe looks up ``"a, b"``)."""
        function = obj if obj.is_function else obj.members.get("__init__")
        if function is None or function.is_alias or obj.docstring is None:
            return
        try:
            parameters = {p.name: p for p in function.parameters}  # type: ignore[union-attr]
        except AttributeError:
            return
        sections = obj.docstring.parsed  # parsed once here (warnings as usual), cached for the renderer
        for section in sections:
            if section.kind is not griffe.DocstringSectionKind.parameters:
                continue
            for entry in section.value:
                names = [n.strip().lstrip("*") for n in re.split(r",|/", entry.name)]
                if len(names) < 2 or not all(n in parameters for n in names):
                    continue
                defaults = {str(parameters[n].default) if parameters[n].default is not None else None
                            for n in names}
                if None in defaults:
                    continue  # one of them is required: say so
                entry.value = defaults.pop() if len(defaults) == 1 else " / ".join(
                    str(parameters[n].default) for n in names)
                if entry.annotation is None:
                    annotations = {str(parameters[n].annotation) for n in names if parameters[n].annotation}
                    if len(annotations) == 1:
                        entry.annotation = parameters[names[0]].annotation
