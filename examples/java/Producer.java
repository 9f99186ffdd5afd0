// Enqueue order timeouts through orderdelay's HTTP API with the JDK's own
// java.net.http.HttpClient (Java 11 or later, no other dependency).
//
//   java Producer.java SERIAL DEADLINE [SERIAL DEADLINE ...]
//
// DEADLINE is the order's payment deadline as an RFC 3339 time with a zone,
// for example 2026-12-01T10:00:00.123456Z: the expires_at your checkout
// stored with the order. Settings come from the environment:
//
//   ORDERDELAY_API_URL     default http://127.0.0.1:8080
//   ORDERDELAY_API_TOKEN   sent as "Authorization: Bearer ..." when set
//
// Exit status: 0 every order queued, 1 the API refused or failed, 2 bad arguments.

import java.io.IOException;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.time.Instant;
import java.time.OffsetDateTime;
import java.time.format.DateTimeParseException;

public final class Producer {
    private final HttpClient http = HttpClient.newBuilder().connectTimeout(Duration.ofSeconds(5)).build();
    private final String apiUrl;
    private final String token;

    Producer(String apiUrl, String token) {
        this.apiUrl = apiUrl.replaceAll("/+$", "");
        this.token = token;
    }

    /**
     * PUT /v1/timeouts/{serial} {"at": deadline}: 201 queued, 200 already queued
     * (its deadline is kept). Without "reschedule" the call is idempotent, so
     * retrying on an IOException or a 503 is safe. Call it after the order row
     * has committed.
     *
     * @return the response (status 200 or 201, body the queue entry as JSON)
     * @throws ApiException on any other status (400 bad input, 401 token, 503)
     */
    HttpResponse<String> enqueue(String serial, Instant deadline) throws IOException, InterruptedException {
        HttpRequest.Builder req = HttpRequest.newBuilder(URI.create(apiUrl + "/v1/timeouts/" + pathSegment(serial)))
                .timeout(Duration.ofSeconds(10))
                .header("Content-Type", "application/json")
                // Instant.toString() is RFC 3339 in UTC, with up to nanoseconds.
                .PUT(HttpRequest.BodyPublishers.ofString("{\"at\":\"" + deadline + "\"}"));
        if (!token.isEmpty()) {
            req.header("Authorization", "Bearer " + token);
        }
        HttpResponse<String> res = http.send(req.build(), HttpResponse.BodyHandlers.ofString());
        if (res.statusCode() != 200 && res.statusCode() != 201) {
            throw new ApiException(res.statusCode(), res.body());
        }
        return res;
    }

    /** Percent-encodes every byte of the serial but RFC 3986's unreserved characters. */
    static String pathSegment(String s) {
        StringBuilder b = new StringBuilder();
        for (byte c : s.getBytes(StandardCharsets.UTF_8)) {
            if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')
                    || c == '-' || c == '.' || c == '_' || c == '~') {
                b.append((char) c);
            } else {
                b.append(String.format("%%%02X", c & 0xff));
            }
        }
        return b.toString();
    }

    static final class ApiException extends IOException {
        final int status;

        ApiException(int status, String body) {
            super("HTTP " + status + ": " + body.strip());
            this.status = status;
        }
    }

    public static void main(String[] args) throws InterruptedException {
        if (args.length == 0 || args.length % 2 != 0) {
            System.err.println("usage: java Producer.java SERIAL DEADLINE [SERIAL DEADLINE ...]");
            System.exit(2);
        }
        Instant[] deadlines = new Instant[args.length / 2];
        for (int i = 0; i < args.length; i += 2) {
            try {
                deadlines[i / 2] = OffsetDateTime.parse(args[i + 1]).toInstant();
            } catch (DateTimeParseException e) {
                System.err.println(args[i] + ": deadline \"" + args[i + 1]
                        + "\": want an RFC 3339 time such as 2026-12-01T10:00:00Z");
                System.exit(2);
            }
        }
        Producer p = new Producer(env("ORDERDELAY_API_URL", "http://127.0.0.1:8080"), env("ORDERDELAY_API_TOKEN", ""));
        for (int i = 0; i < args.length; i += 2) {
            try {
                HttpResponse<String> res = p.enqueue(args[i], deadlines[i / 2]);
                System.out.println(args[i] + ": PUT /v1/timeouts -> " + res.statusCode() + " " + res.body().strip());
            } catch (IOException e) {
                System.err.println(args[i] + ": PUT " + p.apiUrl + ": " + (e.getMessage() != null ? e.getMessage() : e));
                System.exit(1);
            }
        }
    }

    private static String env(String name, String fallback) {
        String v = System.getenv(name);
        return v == null || v.isEmpty() ? fallback : v;
    }
}
