package httpapi

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"reflect"
	"strings"
)

// decodeStrict decodes one JSON value from body into v: unknown fields,
// trailing data, a key given twice in one object and a field name in
// another case than the document's are errors (checkKeys). tooBig reports
// a body past its limit. An empty body is io.EOF.
func decodeStrict(body io.Reader, v any) (tooBig bool, err error) {
	data, err := io.ReadAll(body)
	if err != nil {
		var mb *http.MaxBytesError
		if errors.As(err, &mb) {
			return true, err
		}
		// A read error (a timeout, a reset) names the listener's address:
		// not for the client.
		return false, errors.New("the body could not be read to its end")
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return false, err
	}
	// Only white space may follow. (Decoder.More misses a stray '}' or ']'.)
	if err := dec.Decode(new(json.RawMessage)); !errors.Is(err, io.EOF) {
		return false, errors.New("data after the JSON value")
	}
	return false, checkKeys(data, reflect.TypeOf(v))
}

var rawMessageType = reflect.TypeFor[json.RawMessage]()

// checkKeys refuses what encoding/json lets through: a key given twice in
// one object (it keeps the last; a proxy or a consumer may read the first)
// and a key naming a field of t in another case ("AFTER" for "after"; it
// matches names case-insensitively). Objects not decoded into a struct
// (payloads) are checked for repeated keys only. data has decoded without
// error, so its nesting is within encoding/json's bound.
func checkKeys(data []byte, t reflect.Type) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	return walkKeys(dec, t, "")
}

func walkKeys(dec *json.Decoder, t reflect.Type, at string) error {
	tok, err := dec.Token()
	if err != nil {
		return err
	}
	for t != nil && t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if t == rawMessageType {
		t = nil // opaque: any key, in any case, once
	}
	switch tok {
	case json.Delim('{'):
		seen := map[string]bool{}
		for dec.More() {
			kt, err := dec.Token()
			if err != nil {
				return err
			}
			k, _ := kt.(string)
			if seen[k] {
				return fmt.Errorf("key %q given twice in %s", k, where(at))
			}
			seen[k] = true
			var ft reflect.Type
			switch {
			case t != nil && t.Kind() == reflect.Struct:
				f, name, exact := fieldFor(t, k)
				if f != nil && !exact {
					return fmt.Errorf("unknown field %q in %s: field names are case-sensitive, want %q", k, where(at), name)
				}
				if f != nil {
					ft = f.Type
				}
			case t != nil && t.Kind() == reflect.Map:
				ft = t.Elem()
			}
			if err := walkKeys(dec, ft, at+"."+k); err != nil {
				return err
			}
		}
		_, err := dec.Token() // '}'
		return err
	case json.Delim('['):
		var et reflect.Type
		if t != nil && (t.Kind() == reflect.Slice || t.Kind() == reflect.Array) {
			et = t.Elem()
		}
		for i := 0; dec.More(); i++ {
			if err := walkKeys(dec, et, fmt.Sprintf("%s[%d]", at, i)); err != nil {
				return err
			}
		}
		_, err := dec.Token() // ']'
		return err
	}
	return nil
}

// fieldFor finds the field of struct t that key k decodes into, its JSON
// name, and whether k spells it exactly.
func fieldFor(t reflect.Type, k string) (*reflect.StructField, string, bool) {
	var fold *reflect.StructField
	var foldName string
	for i := range t.NumField() {
		f := t.Field(i)
		if !f.IsExported() {
			continue
		}
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if name == "-" {
			continue
		}
		if name == "" {
			name = f.Name
		}
		if name == k {
			return &f, name, true
		}
		if fold == nil && strings.EqualFold(name, k) {
			fold, foldName = &f, name
		}
	}
	return fold, foldName, false
}

func where(at string) string {
	if at == "" {
		return "the body"
	}
	return strings.TrimPrefix(at, ".")
}
