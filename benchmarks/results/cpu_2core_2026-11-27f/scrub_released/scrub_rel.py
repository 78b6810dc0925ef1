import sys, runpy
sys.path.insert(0, "/work/main/src")
import napari_tileshard.reader.cpu as c
c.RELEASED_DECODE_MIN_READ_BYTES = 0
sys.argv = ["benchmarks/bench_scrub.py"] + sys.argv[1:]
runpy.run_path("/work/main/benchmarks/bench_scrub.py", run_name="__main__")
