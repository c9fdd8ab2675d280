"""Run a probe or check with module constants set first: an A/B of a launcher's switch in one
process, without editing the tree (each NAME=VALUE is `module.CONSTANT=python-expression`).
Usage: python3 scripts/probes/variant.py [module.NAME=VALUE ...] -- SCRIPT [ARGS ...]
e.g.   python3 scripts/probes/variant.py graphtrain.kernels.convpool_tc.FORWARD_TAIL_K4=True \
           -- scripts/probes/cnn_step_profile.py --models 64"""

import importlib
import runpy
import sys

args = sys.argv[1:]
if "--" not in args or args.index("--") == len(args) - 1:
    sys.exit(__doc__)
split = args.index("--")
for assignment in args[:split]:
    name, _, value = assignment.partition("=")
    module, _, constant = name.rpartition(".")
    target = importlib.import_module(module)
    if not hasattr(target, constant):
        sys.exit(f"variant: {module} has no {constant}")
    setattr(target, constant, eval(value))  # a Python expression: True, 2, 80 * 1024, {...}
    print(f"# {name} = {value}")
sys.argv = args[split + 1:]
runpy.run_path(sys.argv[0], run_name="__main__")
