"""The SeaweedFS test server itself: every bucket of a session can take data (each bucket is a SeaweedFS collection that
needs its own volumes; a too-small volume budget once made the 3rd bucket of a session reject every PUT)."""


def test_many_buckets_take_data(s3_server):
    c, buckets = s3_server.client(), [s3_server.make_bucket(f"many{i}") for i in range(12)]
    try:
        for b in buckets:
            c.put_object(Bucket=b, Key="p/x", Body=b"payload-" + b.encode())
            assert [o["Key"] for o in c.list_objects_v2(Bucket=b, Prefix="p/").get("Contents", [])] == ["p/x"], b
            assert c.get_object(Bucket=b, Key="p/x")["Body"].read() == b"payload-" + b.encode()
    finally:  # give the volumes back to the session's other tests
        for b in buckets:
            for o in c.list_objects_v2(Bucket=b).get("Contents", []): c.delete_object(Bucket=b, Key=o["Key"])
            c.delete_bucket(Bucket=b)
