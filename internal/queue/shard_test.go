package queue_test

import (
	"fmt"
	"math/bits"
	"strings"
	"testing"

	"github.com/orderdelay/orderdelay/internal/queue"
)

func TestShardOf(t *testing.T) {
	// CRC-32 (IEEE) values from Python's zlib.crc32, an independent
	// implementation a producer might use.
	tests := []struct {
		serial string
		crc    uint32
	}{
		{"ORD-1001", 0x6E2918E4},
		{"ORD-1002", 0xF720495E},
		{"ORD-1003", 0x802779C8},
		{"123456789", 0xCBF43926}, // the CRC-32 check value
		{"订单-🛒-1", 0xEF0534FB},    // UTF-8 bytes, not runes
	}
	for _, tt := range tests {
		for _, s := range []int{2, 3, 4, 7, 16, 1024} {
			if got, want := queue.ShardOf(tt.serial, s), int(tt.crc%uint32(s)); got != want {
				t.Errorf("ShardOf(%q, %d) = %d, want %d", tt.serial, s, got, want)
			}
		}
	}
	if got := queue.ShardOf("ORD-1002", 4); got != 2 {
		t.Errorf("ShardOf(ORD-1002, 4) = %d, want 2 (the documented example)", got)
	}
	for _, s := range []int{-1, 0, 1} {
		if got := queue.ShardOf("ORD-1002", s); got != 0 {
			t.Errorf("ShardOf(_, %d) = %d, want 0", s, got)
		}
	}
	// Serials with a common prefix and a counter spread evenly.
	const n, shards = 100000, 8
	var counts [shards]int
	for i := range n {
		counts[queue.ShardOf(fmt.Sprintf("ORD-2026-%07d", i), shards)]++
	}
	for sh, c := range counts {
		if c < n/shards*95/100 || c > n/shards*105/100 {
			t.Errorf("shard %d got %d of %d sequential serials, want within 5%% of %d", sh, c, n, n/shards)
		}
	}
}

func TestHashSlotMatchesSpec(t *testing.T) {
	for _, key := range []string{"foo", "123456789", "{user1000}.following", "{user1000}.followers",
		"foo{}{bar}", "foo{{bar}}zap", "foo{bar}{zap}", "{", "}", "{}", "a{b", queue.DefaultKey,
		"{" + queue.DefaultKey + "}:inflight", "订单"} {
		if got, want := queue.HashSlot(key), keySlot(key); got != want {
			t.Errorf("HashSlot(%q) = %d, want %d", key, got, want)
		}
	}
	// From the Redis Cluster specification.
	if got := queue.HashSlot("foo{{bar}}zap"); got != keySlot("{bar") {
		t.Errorf("HashSlot(foo{{bar}}zap) = %d, want the slot of %q", got, "{bar")
	}
}

func TestShardKeys(t *testing.T) {
	for _, base := range []string{queue.DefaultKey, "shop-7:orders", "订单", "a"} {
		t.Run(base, func(t *testing.T) {
			keys := queue.ShardKeys(base, queue.MaxShards)
			if len(keys) != queue.MaxShards {
				t.Fatalf("%d shard keys, want %d", len(keys), queue.MaxShards)
			}
			slots := map[uint16]int{}
			for n, k := range keys {
				name := k.Queue
				if !strings.HasPrefix(name, fmt.Sprintf("%s#%d.", base, n)) {
					t.Fatalf("shard %d is %q, want prefix %s#%d.", n, name, base, n)
				}
				if err := queue.ValidateKey(name); err != nil {
					t.Fatalf("shard %d key %q is not a valid queue key: %v", n, name, err)
				}
				if name != queue.ShardKey(base, n) {
					t.Fatalf("ShardKeys[%d] = %q, ShardKey = %q", n, name, queue.ShardKey(base, n))
				}
				// The shard and every companion share one slot, by the
				// independent slot function of queue_test.go.
				slot := keySlot(name)
				for _, c := range []string{k.Inflight, k.Deadlines, k.Lease, k.Dead, k.DeadInfo, k.Wake, k.Paused} {
					if keySlot(c) != slot {
						t.Fatalf("shard %d: companion %q is in slot %d, the shard %q in %d", n, c, keySlot(c), name, slot)
					}
				}
				if prev, dup := slots[slot]; dup {
					t.Fatalf("shards %d and %d share slot %d", prev, n, slot)
				}
				slots[slot] = n
				if want := bits.Reverse16(uint16(n)) >> 6; slot/16 != want {
					t.Errorf("shard %d in slot %d, want slots %d..%d", n, slot, want*16, want*16+15)
				}
				if slot == keySlot(base) {
					t.Errorf("shard %d shares the base key's slot %d", n, slot)
				}
			}
			// The first S shards of a power of two S are evenly spaced:
			// each lies in its own 16384/S-slot stretch.
			for _, s := range []int{2, 4, 8, 64} {
				seen := map[uint16]bool{}
				for n := range s {
					stretch := keySlot(keys[n].Queue) / uint16(16384/s)
					if seen[stretch] {
						t.Errorf("S=%d: two shards in slots %d..%d", s, stretch*uint16(16384/s), (stretch+1)*uint16(16384/s)-1)
					}
					seen[stretch] = true
				}
			}
		})
	}
	// The documented names (docs/scaling.md, computed there by the Python
	// snippet).
	for n, want := range []string{"delaytask:order#0.787", "delaytask:order#1.351", "delaytask:order#2.925", "delaytask:order#3.73"} {
		if got := queue.ShardKey(queue.DefaultKey, n); got != want {
			t.Errorf("ShardKey(%q, %d) = %q, want %q", queue.DefaultKey, n, got, want)
		}
	}
	if keys := queue.ShardKeys(queue.DefaultKey, 1); keys != nil {
		t.Errorf("ShardKeys(_, 1) = %v, want none", keys)
	}
	if got := queue.KeyFor(queue.DefaultKey, "ORD-1002", 1); got != queue.DefaultKey {
		t.Errorf("KeyFor(_, _, 1) = %q, want the base key", got)
	}
	if got := queue.KeyFor(queue.DefaultKey, "ORD-1002", 4); got != "delaytask:order#2.925" {
		t.Errorf("KeyFor(ORD-1002, 4) = %q, want delaytask:order#2.925", got)
	}
}
