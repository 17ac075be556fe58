#!/bin/bash
# The note the solution wrote as the image's user, in its workdir.
mkdir -p /logs/verifier
note=/home/worker/project/note.txt
ok=1
[[ $(cat "$note") == "hello from worker in /home/worker/project" ]] || { echo "note: $(cat "$note")"; ok=0; }
[[ $(stat -c %U "$note") == worker ]] || { echo "note owned by $(stat -c %U "$note")"; ok=0; }
echo "$ok" >/logs/verifier/reward.txt
