package tasks

import (
	"os"
	"testing"

	"github.com/orderdelay/orderdelay/internal/testenv"
)

// The tests mostly wait (on PostgreSQL, on statement timeouts and leases),
// so more of them run at once than there are cores.
func TestMain(m *testing.M) {
	testenv.SetDefaultParallel(4)
	os.Exit(m.Run())
}
