package orders

import (
	"database/sql"
	"embed"
	"errors"
	"fmt"
	"io/fs"

	"github.com/golang-migrate/migrate/v4"
	"github.com/golang-migrate/migrate/v4/database/postgres"
	"github.com/golang-migrate/migrate/v4/source/iofs"
)

//go:embed migrations/*.sql
var migrationFS embed.FS

// SchemaVersion is the version the embedded migrations bring the schema to.
const SchemaVersion = 3

// MigrationsTable is where the schema version is recorded.
const MigrationsTable = "orderdelay_schema_migrations"

// Migrate brings the reference schema up to date in the database at dsn,
// on a connection of its own. It is idempotent, and safe to run from several
// pods at once: golang-migrate holds a PostgreSQL advisory lock while it
// works. It returns the version reached.
func Migrate(dsn string) (uint, error) {
	db, err := sql.Open("postgres", dsn)
	if err != nil {
		return 0, fmt.Errorf("migrations: %w", err)
	}
	src, err := iofs.New(migrationFS, "migrations")
	if err != nil {
		return 0, fmt.Errorf("migrations: %w", err)
	}
	drv, err := postgres.WithInstance(db, &postgres.Config{MigrationsTable: MigrationsTable})
	if err != nil {
		db.Close()
		return 0, fmt.Errorf("migrations: %w", err)
	}
	m, err := migrate.NewWithInstance("iofs", src, "postgres", drv)
	if err != nil {
		drv.Close()
		return 0, fmt.Errorf("migrations: %w", err)
	}
	defer m.Close() // closes db too
	if err := m.Up(); err != nil && !errors.Is(err, migrate.ErrNoChange) {
		return 0, fmt.Errorf("migrate: %w", err)
	}
	v, dirty, err := m.Version()
	if err != nil {
		return 0, fmt.Errorf("migrate: %w", err)
	}
	if dirty {
		return v, fmt.Errorf("migrate: schema version %d is dirty: a migration failed halfway; fix it by hand", v)
	}
	return v, nil
}

// MigrationFiles returns the embedded migrations (for tests that build a
// template database once per schema version).
func MigrationFiles() fs.FS {
	sub, err := fs.Sub(migrationFS, "migrations")
	if err != nil {
		panic(err) // the directory is embedded at build time
	}
	return sub
}
