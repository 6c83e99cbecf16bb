"""
The documents and the layout against the code: the launch counts that docs/PERFORMANCE.md
documents at 4 layers are the ones test_kernels.py and test_decode.py pin (OPERATORS,
DECODE_OPERATORS); docs/RESULTS.md's depth table is what the committed result files give;
docs/METHODS.md has a section for every registered method; the relative links
of every page lead to files (and headings) that exist; nothing a user gets points outside the repository; residuals.py stands alone and the
project's imports have no circle; no function outside the Triton kernels is over 60 lines. No
model runs here.
"""
import ast
import os
import re
import statistics

import pytest

import sweep
from residuals import RESIDUALS
from test_decode import DECODE_OPERATORS
from test_kernels import OPERATORS

ROOT = os.path.dirname(os.path.abspath(__file__))
PERFORMANCE = os.path.join(ROOT, 'docs', 'PERFORMANCE.md')
MARKER = '<!-- test_docs.py parses this table'  # the comment right above the 4-layer table
DECODE_MARKER = '<!-- test_docs.py parses this decode table'  # ... and above the decode step's
COUNTS = {('torch', 'compute'): 'torch compute', ('torch', 'views'): 'torch views',
          ('triton', 'compute'): 'triton compute', ('triton', 'views'): 'triton views'}
SUBLAYERS = 8  # 4 layers, as in test_operators_per_training_step_are_pinned


def cells(line):
    return [c.strip() for c in line.strip().strip('|').split('|')]


def number(text):
    return float(text.replace(',', '').replace('*', '').replace('+', '').strip())


def launch_table(text, marker=MARKER):
    """{method: {column name: cell}} of the first markdown table after the marker."""
    start = text.find(marker)
    assert start >= 0, f"docs/PERFORMANCE.md: no line starting {marker!r} above its launch table"
    lines = text[start:].splitlines()[1:]
    while lines and not lines[0].lstrip().startswith('|'):
        lines.pop(0)
    rows = []
    for line in lines:
        if not line.lstrip().startswith('|'):
            break
        rows.append(cells(line))
    assert len(rows) >= 3, "docs/PERFORMANCE.md: the 4-layer launch table after the marker has no rows"
    header = [h.lower() for h in rows[0]]
    missing = [name for name in ['method', *COUNTS.values()] if name not in header]
    assert not missing, f"docs/PERFORMANCE.md's 4-layer launch table lacks the columns {missing}; it has {header}"
    table = {}
    for row in rows[2:]:  # rows[1] is the |---| line
        assert len(row) == len(header), \
            f"docs/PERFORMANCE.md: launch table row {row} has {len(row)} cells, not {len(header)}"
        method = row[header.index('method')].strip('`* ')
        assert method not in table, f"docs/PERFORMANCE.md: the launch table lists {method} twice"
        table[method] = dict(zip(header, row))
    return table


def check_launch_table(text, pinned):
    """The mismatches between the documented table and the pinned counts, one sentence each."""
    table = launch_table(text)
    methods = set(pinned['torch']) | set(pinned['triton'])
    problems = [f"{m}: pinned in test_kernels.OPERATORS but not in docs/PERFORMANCE.md's 4-layer table"
                for m in sorted(methods - set(table))]
    problems += [f"{m}: in docs/PERFORMANCE.md's 4-layer table but not pinned in test_kernels.OPERATORS"
                 for m in sorted(set(table) - methods)]
    for method in sorted(methods & set(table)):
        for (backend, kind), column in COUNTS.items():
            want = pinned[backend][method][0 if kind == 'compute' else 1]
            got = table[method][column]
            if not re.fullmatch(r'[\d,]+', got) or int(got.replace(',', '')) != want:
                problems.append(f"{method}: docs/PERFORMANCE.md says {column} = {got}, "
                                f"test_kernels.OPERATORS pins {want}")
    # the derived columns, where the table has them, follow from the counts
    for backend in ('torch', 'triton'):
        extra, views = f'{backend} extra / sublayer', f'{backend} views x prenorm'
        base_compute, base_views = pinned[backend]['prenorm']
        for method in sorted(methods & set(table)):
            compute, view_count = pinned[backend][method]
            if extra in table[method]:
                want = (compute - base_compute) / SUBLAYERS
                if abs(number(table[method][extra]) - want) > 0.05 + 1e-9:
                    problems.append(f"{method}: docs/PERFORMANCE.md says {extra} = {table[method][extra]}, "
                                    f"the pinned counts give {want:+.2f}")
            if views in table[method]:
                want = view_count / base_views
                if abs(number(table[method][views]) - want) > 0.005 + 1e-9:
                    problems.append(f"{method}: docs/PERFORMANCE.md says {views} = {table[method][views]}, "
                                    f"the pinned counts give {want:.3f}")
    return problems


def test_documented_launch_counts_are_the_pinned_ones():
    """docs/PERFORMANCE.md's 4-layer table (torch and triton, compute operators and views per
    training step) equals OPERATORS in test_kernels.py, method by method; a count changed in one
    place must be changed in the other."""
    with open(PERFORMANCE, encoding='utf-8') as f:
        problems = check_launch_table(f.read(), OPERATORS)
    assert not problems, "docs/PERFORMANCE.md and test_kernels.OPERATORS disagree:\n" + '\n'.join(problems)


def test_the_launch_check_names_the_method_and_both_numbers():
    """The check above can fail: one count changed in a copy of the page is reported with the
    method, the documented number and the pinned one."""
    with open(PERFORMANCE, encoding='utf-8') as f:
        text = f.read()
    start = text.find(MARKER)
    row = re.search(r'^\| wav \| (\d+) \|', text[start:], re.M)
    assert row, "docs/PERFORMANCE.md's 4-layer table has no wav row"
    pinned = OPERATORS['torch']['wav'][0]
    i = start + row.start(1)
    changed = text[:i] + str(pinned + 1) + text[i + len(row.group(1)):]
    problems = check_launch_table(changed, OPERATORS)
    assert f"wav: docs/PERFORMANCE.md says torch compute = {pinned + 1}, test_kernels.OPERATORS pins {pinned}" \
        in problems, problems


def test_documented_decode_launches_are_the_pinned_ones():
    """docs/PERFORMANCE.md's decode table (operators of one decode step at 4 layers) equals
    DECODE_OPERATORS in test_decode.py, method by method."""
    with open(PERFORMANCE, encoding='utf-8') as f:
        table = launch_table(f.read(), DECODE_MARKER)
    problems = [f"{m}: pinned in test_decode.DECODE_OPERATORS, not in the decode table" for m in
                sorted(set(DECODE_OPERATORS['torch']) - set(table))]
    for method in sorted(set(table) & set(DECODE_OPERATORS['torch'])):
        for (backend, kind), column in COUNTS.items():
            want = DECODE_OPERATORS[backend][method][0 if kind == 'compute' else 1]
            if table[method][column].replace(',', '') != str(want):
                problems.append(f"{method}: the decode table says {column} = {table[method][column]}, "
                                f"test_decode.DECODE_OPERATORS pins {want}")
    assert not problems, "docs/PERFORMANCE.md and test_decode.DECODE_OPERATORS disagree:\n" + '\n'.join(problems)


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r'[^\w\- ]', '', heading.strip().lower()).replace(' ', '-')


# ----------------------------------------------------------------------------- the depth study's table

DEPTH_MARKER = '<!-- test_docs.py rebuilds this table from results/cpu_depth'  # the comment right above it
DEPTH_NAMES = {'mgr-mgr_gateindependent': 'mgr independent', 'mgr-mgr_streams8': 'mgr n=8',
               'mgr-mgr_streams8-mgr_gateindependent': 'mgr n=8, independent'}  # the grid's variants, as the table names them


def depth_name(method):
    """A run's method as the table names it: MGR's settings by DEPTH_NAMES, a rate variant as 'mudd at 5e-4'."""
    rate = re.fullmatch(r'(\w+)-learning_rate([0-9.e-]+)-min_lr[0-9.e-]+', method)
    return DEPTH_NAMES.get(method) or (f'{rate[1]} at {rate[2]}' if rate else method)


def depth_cell(diff, half, fewer=''):
    """A paired difference to 3 places: bold where its 95% interval excludes zero."""
    if half is None:
        return f'{diff:+.3f} (1 seed)'
    text = f'{diff:+.3f} ± {half:.3f}'
    return (text if sweep.verdict(diff, half) == 'unresolved' else f'**{text}**') + fewer


def depth_table():
    """docs/RESULTS.md's depth table as the committed result files give it: sweep.py's report
    (comparisons, step ratios, equal time) rounded once, a row per method and depth in its order."""
    results_dir = os.path.join(ROOT, 'results')
    results = [r for r in sweep.load_results('cpu_depth', results_dir) if r['final'] is not None]
    ratios = sweep.step_ratios('cpu_depth', results_dir)
    timed = sweep.equal_time(results, ratios)
    timed_as = {(r['group'], r['method']): sweep.timed_as(r) for r in results}
    lines = ["| method | layers | seeds | val loss, mean ± sd | minus prenorm | minus block_attnres | step x prenorm | "
             "at prenorm's time, minus prenorm |", '|---|---:|---:|---:|---|---|---:|---|']
    for row in sweep.comparisons(results, ('prenorm', 'block_attnres')):
        losses = list(row['losses'].values())
        sd = statistics.stdev(losses) if len(losses) > 1 else 0.0
        cells, fewer = [], {}
        for ref in ('prenorm', 'block_attnres'):
            if ref in row['versus']:
                diff, half, n = row['versus'][ref]
                fewer[ref] = f' ({n} paired)' if n < len(losses) else ''
                cells.append(depth_cell(diff, half, fewer[ref]))
            else:
                cells.append('-')
        ratio = sweep.ratios_of(ratios, row['group']).get(timed_as[row['group'], row['method']])
        at_time = timed.get((row['group'], row['method']), (None, None))[0]
        cells += ['-' if ratio is None else f'{ratio:.2f}',
                  '-' if at_time is None else depth_cell(*at_time[:2], fewer.get('prenorm', ''))]
        lines.append(f"| {depth_name(row['method'])} | {sweep.group_number(row['group'])} | {len(losses)} | "
                     f"{statistics.mean(losses):.3f} ± {sd:.3f} | " + ' | '.join(cells) + ' |')
    return lines


def test_the_depth_table_is_what_the_result_files_give():
    """docs/RESULTS.md's depth table, row for row, is the committed runs' (results/cpu_depth/*.json):
    a run that lands changes it, and a figure typed by hand cannot drift. The message gives the table
    to paste."""
    text = open(os.path.join(ROOT, 'docs', 'RESULTS.md')).read()
    start = text.find(DEPTH_MARKER)
    assert start >= 0, f"docs/RESULTS.md: no line starting {DEPTH_MARKER!r} above the depth table"
    lines = text[start:].splitlines()[1:]
    table = lines[:next((k for k, line in enumerate(lines) if not line.startswith('|')), len(lines))]
    want = depth_table()
    assert table == want, "docs/RESULTS.md's depth table is not the result files'; it should read:\n" + '\n'.join(want)


PAGES = ['README.md', 'CONTRIBUTING.md', 'docs/METHODS.md', 'docs/PERFORMANCE.md', 'docs/RESULTS.md']


@pytest.mark.parametrize('page', PAGES)
def test_relative_links_resolve(page):
    """Every relative link and image of the page names a file of the repository, and every anchor
    into a markdown page names one of its headings."""
    path = os.path.join(ROOT, page)
    with open(path, encoding='utf-8') as f:
        text = re.sub(r'```.*?```', '', f.read(), flags=re.S)
    broken = []
    for target in re.findall(r'\]\(([^)\s]+)\)', text):
        if re.match(r'[a-z]+:', target):
            continue
        file, _, anchor = target.partition('#')
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if not os.path.exists(resolved):
            broken.append(f"{target}: no {os.path.relpath(resolved, ROOT)}")
        elif anchor and resolved.endswith('.md'):
            with open(resolved, encoding='utf-8') as f:
                anchors = {slug(h) for h in re.findall(r'^#+ (.+)$', f.read(), re.M)}
            if anchor not in anchors:
                broken.append(f"{target}: no heading #{anchor} in {os.path.relpath(resolved, ROOT)}")
    assert not broken, f"{page}: broken links: {broken}"


def test_methods_page_has_a_section_for_every_registered_method_in_order():
    """docs/METHODS.md, the maths contract, has one `## `name`: ...` section per name in
    RESIDUALS, in the registry's order."""
    with open(os.path.join(ROOT, 'docs', 'METHODS.md'), encoding='utf-8') as f:
        sections = re.findall(r'^## `(\w+)`', f.read(), re.M)
    assert sections == list(RESIDUALS), f"docs/METHODS.md's method sections {sections}, RESIDUALS {list(RESIDUALS)}"


def test_the_readme_methods_table_has_a_row_for_every_registered_method_in_order():
    """README's methods table (its `--residual=` column) lists RESIDUALS, in the registry's order."""
    with open(os.path.join(ROOT, 'README.md'), encoding='utf-8') as f:
        section = f.read().split('\n## Methods\n')[1].split('\n## ')[0]
    rows = re.findall(r'^\| `(\w+)` \|', section, re.M)
    assert rows == list(RESIDUALS), f"README's methods table {rows}, RESIDUALS {list(RESIDUALS)}"


def user_files():
    """What a user's clone holds beside the tests, CI and the results: the scripts, the pages and
    the configs."""
    top = [name for name in os.listdir(ROOT) if name.endswith(('.py', '.md', '.txt'))
           and not name.startswith('test_') and name != 'conftest.py']
    folders = [os.path.join(folder, name) for folder in ('config', 'docs', 'kernels')
               for name in os.listdir(os.path.join(ROOT, folder)) if name != '__pycache__']
    return sorted(top + folders)


def test_nothing_a_user_gets_points_outside_the_repository():
    """No script, page or config cites a document or data folder that only the developers have
    (a clone has docs/METHODS.md as its contract and prepares its data with data.py)."""
    outside = re.compile(r'\.\./shared|\bSPEC\b')
    found = []
    for name in user_files():
        with open(os.path.join(ROOT, name), encoding='utf-8') as f:
            found += [f"{name}:{k}: {line.strip()}" for k, line in enumerate(f, 1) if outside.search(line)]
    assert 'README.md' in user_files() and 'config/cpu_depth.py' in user_files()
    assert not found, "these lines point outside the repository:\n" + '\n'.join(found)


def module_files(name):
    """The files of a project module: name.py, or every file of the package name/."""
    if os.path.isdir(os.path.join(ROOT, name)):
        return sorted(os.path.join(ROOT, name, n) for n in os.listdir(os.path.join(ROOT, name)) if n.endswith('.py'))
    return [os.path.join(ROOT, name + '.py')]


def project_modules():
    return {n[:-3] if n.endswith('.py') else n for n in os.listdir(ROOT)
            if n.endswith('.py') or os.path.isfile(os.path.join(ROOT, n, '__init__.py'))}


def top_level_imports(name):
    """The import statements at the top of a module's files (not inside functions)."""
    nodes = []
    for path in module_files(name):
        with open(path, encoding='utf-8') as f:
            nodes += [n for n in ast.parse(f.read()).body if isinstance(n, (ast.Import, ast.ImportFrom))]
    return nodes


def project_imports(name):
    """The project's modules that a module (a file, or a package's files together) imports, anywhere
    in it (inside functions too); a package's imports of its own files are not counted."""
    project = project_modules()
    trees = []
    for path in module_files(name):
        with open(path, encoding='utf-8') as f:
            trees.append(ast.parse(f.read()))
    names = set()
    for node in (node for tree in trees for node in ast.walk(tree)):
        if isinstance(node, ast.Import):
            names |= {alias.name.split('.')[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split('.')[0])
    return names & project - {name}


def test_residuals_stands_alone_and_the_imports_have_no_circle():
    """residuals.py (the maths) imports no module of the project; the kernels package imports it at
    its top; following the imports of the scripts never leads back to where it started."""
    assert project_imports('residuals') == set()
    assert any('residuals' in ast.unparse(n) for n in top_level_imports('kernels'))
    modules = [m for m in project_modules() if not m.startswith(('test_', 'conftest'))]
    graph = {m: project_imports(m) for m in modules}

    def circle_from(module, path):
        for imported in graph.get(module, ()):
            if imported in path:
                return path[path.index(imported):] + [imported]
            found = circle_from(imported, path + [imported])
            if found:
                return found
        return None
    circles = [c for m in modules if (c := circle_from(m, [m]))]
    assert not circles, f"import circles: {circles}"


def test_no_function_outside_the_triton_kernels_is_over_60_lines():
    """A newcomer reads every function on one screen; the Triton kernels (@triton.jit) alone may
    be longer, where their parts do not separate."""
    long = []
    for name in sorted(n for n in os.listdir(ROOT) if n.endswith('.py') and not n.startswith(('test_', 'conftest'))):
        with open(os.path.join(ROOT, name), encoding='utf-8') as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60 \
                    and not any('triton.jit' in ast.unparse(d) for d in node.decorator_list):
                long.append(f"{name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, f"functions over 60 lines: {long}"
