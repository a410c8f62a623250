import sys, runpy
sys.path.insert(0, "/tmp"); sys.path.insert(0, "tools")
import patch_prof
sys.argv = ["tools/bench_dpo.py"] + sys.argv[1:]
runpy.run_path("tools/bench_dpo.py", run_name="__main__")
