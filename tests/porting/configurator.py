# --key=value arguments override train.py's globals of the same name (as nanoGPT's configurator.py)
import sys
from ast import literal_eval

for arg in sys.argv[1:]:
    key, _, value = arg.removeprefix('--').partition('=')
    if key not in globals():
        raise ValueError(f"unknown option --{key}")
    try:
        globals()[key] = literal_eval(value)
    except (SyntaxError, ValueError):
        globals()[key] = value
