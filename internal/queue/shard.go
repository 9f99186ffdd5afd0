package queue

import (
	"hash/crc32"
	"math/bits"
	"strconv"
	"sync"
)

// Sharded queues (ORDERDELAY_QUEUE_SHARDS=S, S > 1) spread one logical queue
// over S sorted sets, each in a hash slot of its own, so that on Redis
// Cluster the queue's Redis work is spread over masters. The queue key Q
// itself stays a queue: producers that ignore sharding keep writing it and
// the daemon keeps serving it.
//
// Which shard: CRC-32 (IEEE 802.3, the checksum of zlib, gzip, PNG,
// Python's zlib.crc32, Java's java.util.zip.CRC32, PHP's and MySQL's
// crc32()) of the serial's UTF-8 bytes, as an unsigned 32-bit number,
// modulo S. Example: CRC-32("ORD-1002") = 0xF720495E = 4146088286, and
// 4146088286 mod 4 = 2, so with S = 4 that order goes to shard 2, whose key
// for the default queue is "delaytask:order#2.925".
//
// Shard keys: shard n of Q is named
//
//	Q#<n>.<k>
//
// where k is the smallest integer ≥ 0 for which the name's Redis Cluster
// hash slot, divided by 16 (integer division), equals the 10-bit reversal of
// n, and is not Q's own slot. Its companions are named as any queue's, {Q#<n>.<k>}:<suffix>, so the
// shard and its companions share one slot. Because of the bit reversal, the
// first S shards sit in S distinct slots evenly spaced over the 16,384 for
// every S that is a power of two (shard 0 near slot 0, shard 1 near 8192,
// shards 2 and 3 near 4096 and 12288, ...), and in distinct slots for any S
// up to MaxShards; so they spread over the masters of a cluster whose slots
// were split evenly (redis-cli --cluster create or rebalance). A shard's
// name depends on Q and n only, not on S: raising S keeps the first shards'
// names.
//
// Producers in other languages need not search: `orderdelay shards` prints
// the names (and their slots) for a configuration.

// MaxShards is the most shards a queue may be spread over.
const MaxShards = 1024

// slotBuckets is the number of slot ranges shards are placed in: 16 slots
// each, one per possible shard.
const slotBuckets = 16384 / MaxShards

// ShardOf returns the shard, from 0 to shards-1, of serial: CRC-32 (IEEE)
// of its bytes modulo shards. It returns 0 when shards ≤ 1.
func ShardOf(serial string, shards int) int {
	if shards <= 1 {
		return 0
	}
	return int(crc32.ChecksumIEEE([]byte(serial)) % uint32(shards))
}

var shardNames sync.Map // "Q\x00n" -> shard key

// ShardKey returns the key of shard n (0 ≤ n < MaxShards) of the queue named
// base, which must be a valid queue key (see ValidateKey).
func ShardKey(base string, n int) string {
	if n < 0 || n >= MaxShards {
		panic("queue: shard " + strconv.Itoa(n) + " out of range")
	}
	id := base + "\x00" + strconv.Itoa(n)
	if v, ok := shardNames.Load(id); ok {
		return v.(string)
	}
	want := uint16(bits.Reverse16(uint16(n)) >> 6) // 10-bit reversal
	prefix := base + "#" + strconv.Itoa(n) + "."
	avoid := HashSlot(base)
	var name string
	for k := 0; ; k++ {
		name = prefix + strconv.Itoa(k)
		if slot := HashSlot(name); slot/slotBuckets == want && slot != avoid {
			break
		}
	}
	shardNames.Store(id, name)
	return name
}

// ShardKeys returns the keys of shards 0 to shards-1 of the queue named
// base; none when shards ≤ 1 (the queue is not sharded).
func ShardKeys(base string, shards int) []Keys {
	if shards <= 1 {
		return nil
	}
	out := make([]Keys, shards)
	for n := range out {
		out[n] = NewKeys(ShardKey(base, n))
	}
	return out
}

// KeyFor returns the key a producer writes serial to: base when shards ≤ 1,
// else the key of the serial's shard.
func KeyFor(base, serial string, shards int) string {
	if shards <= 1 {
		return base
	}
	return ShardKey(base, ShardOf(serial, shards))
}

// HashSlot is Redis Cluster's HASH_SLOT of key (what CLUSTER KEYSLOT
// answers): CRC16-XMODEM of the key, or of the part between the first '{'
// and the first '}' after it when that part is not empty, modulo 16384.
func HashSlot(key string) uint16 {
	for i := 0; i < len(key); i++ {
		if key[i] == '{' {
			for j := i + 1; j < len(key); j++ {
				if key[j] == '}' {
					if j > i+1 {
						key = key[i+1 : j]
					}
					return crc16(key) % 16384
				}
			}
			break
		}
	}
	return crc16(key) % 16384
}

// crc16Table is CRC16-XMODEM (polynomial 0x1021, initial value 0), the
// checksum Redis Cluster hashes keys with.
var crc16Table = func() (t [256]uint16) {
	for i := range t {
		c := uint16(i) << 8
		for range 8 {
			if c&0x8000 != 0 {
				c = c<<1 ^ 0x1021
			} else {
				c <<= 1
			}
		}
		t[i] = c
	}
	return t
}()

func crc16(s string) uint16 {
	var c uint16
	for i := 0; i < len(s); i++ {
		c = c<<8 ^ crc16Table[byte(c>>8)^s[i]]
	}
	return c
}
