# Sourced by the device scripts: a call's parts, each run only when asked for and when the call's
# time limit leaves enough for it.  Needs LIMIT_S (seconds for the whole call), PARTS (the parts
# asked for, comma-separated) and PARTS_LOG (the folder for parts.txt and skipped.txt).
left() { echo $((LIMIT_S - SECONDS)); }
want() { # want PART SECONDS_NEEDED: whether to run it (asked for, and time enough left)
  case ",$PARTS," in *",$1,"*) ;; *) return 1 ;; esac
  if [ "$(left)" -lt "$2" ]; then
    echo "# part $1 skipped: $(left) s left, it needs about $2 s" | tee -a "$PARTS_LOG/skipped.txt"
    return 1
  fi
  echo "# part $1 at ${SECONDS} s" | tee -a "$PARTS_LOG/parts.txt"
}
machine_info() { # the machine (CPUs, memory, GPU) into $PARTS_LOG/info.txt, and on stdout
  { nproc; free -g | head -2; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null; } \
    > "$PARTS_LOG/info.txt" 2>&1
  cat "$PARTS_LOG/info.txt"
}
