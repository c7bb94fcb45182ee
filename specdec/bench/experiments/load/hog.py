import time, sys
busy, idle = float(sys.argv[1]), float(sys.argv[2])
end = time.time() + float(sys.argv[3])
while time.time() < end:
    t = time.perf_counter()
    while time.perf_counter() - t < busy: pass
    time.sleep(idle)
